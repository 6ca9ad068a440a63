"""The daemon's command line as an operator meets it: --version, --help, one-line refusals.

Every refusal is checked on a real process (``python -m blockd.server``): exit status 2, one
line on stderr that names the field (and the source of a bad value), no traceback, nothing on
stdout, and nothing left behind or taken away in the socket directory. A daemon never takes
over a live daemon's socket; a dead one's is reclaimed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from cli_support import Served, clean_env, listening_port, run_refused, write_config
from grpc_health.v1 import health_pb2, health_pb2_grpc

import blockd
from blockd import config
from blockd.api.v1 import blockd_pb2 as pb
from blockd.api.v1 import blockd_pb2_grpc as pb_grpc
from blockd.core.errors import InvalidArgument

ROOT = Path(__file__).resolve().parents[2]


def one_line(out: subprocess.CompletedProcess[str], *needles: str) -> str:
    """The refusal's single stderr line, after checking the exit status and the needles."""
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert out.stdout == "", out.stdout
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert "Traceback" not in out.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def answers(unix_socket: str) -> bool:
    with grpc.insecure_channel(f"unix:{unix_socket}") as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        stats = pb_grpc.BlockdServiceStub(ch).Stats(pb.StatsRequest(), timeout=10)
    return r.status == health_pb2.HealthCheckResponse.SERVING and stats.num_blocks == 16


# -- --version and --help ---------------------------------------------------------------------

@pytest.mark.parametrize("argv", [("-m", "blockd.server", "--version"),
                                  ("-m", "blockd_apps", "--version"),
                                  ("-m", "blockd_apps", "serve", "--version")])
def test_version_is_the_package_version(argv: tuple[str, ...]) -> None:
    out = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"blockd {blockd.__version__}\n"


def test_the_installed_distribution_has_the_same_version() -> None:
    assert importlib.metadata.version("blockd") == blockd.__version__


def test_every_flag_says_what_it_does() -> None:
    """One description per field is the flag's help: non-empty, more than its default, and
    what ``--help`` prints next to the flag."""
    out = subprocess.run([sys.executable, "-m", "blockd.server", "--help"], capture_output=True,
                         text=True, timeout=60, check=True)
    text = "".join(out.stdout.split())  # argparse wraps lines, at spaces and hyphens
    seen = set()
    for s in config.settings():
        assert len(s.help.split()) >= 3, s.key
        assert not s.help.startswith("(default"), s.key
        assert s.help.strip(" .'\"") != str(s.default), s.key
        metavar = s.type.__name__.upper()
        assert f"{s.flag}{metavar}{''.join(s.help.split())}" in text, s.key
        seen.add(s.flag)
    flags = {w.rstrip(",") for w in out.stdout.split() if w.startswith("--")}
    assert flags == seen | {"--help", "--version", "--config"}


def test_every_field_has_a_description_and_a_field_without_one_is_refused() -> None:
    assert all(s.help for s in config.settings())
    with pytest.raises(TypeError, match="needs a description"):
        config.option(1, "  ")


def test_the_docs_table_is_generated_from_the_descriptions() -> None:
    """docs/operations.md carries config.markdown_table() verbatim (tools/config_docs.py)."""
    docs = (ROOT / "docs" / "operations.md").read_text()
    assert config.markdown_table() in docs, "run tools/config_docs.py"
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "config_docs.py"), "--check"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


# -- bad configuration: one line, the field and where the value came from --------------------

def test_a_missing_config_file(tmp_path: Path) -> None:
    one_line(run_refused("--config", str(tmp_path / "nope.yaml"), cwd=tmp_path),
             "blockd: bad configuration: config:", str(tmp_path / "nope.yaml"),
             "No such file")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("source", ["flag", "env", "yaml"])
def test_a_bad_value_names_the_field_and_its_source(tmp_path: Path, source: str) -> None:
    args: list[str] = []
    env = clean_env()
    if source == "flag":
        args, where = ["--pool-num-blocks", "many"], "from --pool-num-blocks"
    elif source == "env":
        env["BLOCKD_POOL_NUM_BLOCKS"], where = "many", "from $BLOCKD_POOL_NUM_BLOCKS"
    else:
        path = tmp_path / "blockd.yaml"
        path.write_text("pool:\n  num_blocks: many\n")
        args, where = ["--config", str(path)], f"from {path}"
    line = one_line(run_refused(*args, cwd=tmp_path, env=env),
                    "blockd: bad configuration: pool.num_blocks ", where,
                    "expected an integer, got 'many'")
    assert config.describe("pool.num_blocks").rstrip(".") in line  # the field's description


def test_a_value_refused_by_a_check_names_the_source_that_set_it(tmp_path: Path) -> None:
    """A check that runs after every source merged still names the one that set the value."""
    path = tmp_path / "blockd.yaml"
    path.write_text("lease: {min_ms: 5000}\n")
    one_line(run_refused("--config", str(path), "--lease-max-ms", "1000", cwd=tmp_path),
             "lease.min_ms from", "is above lease.max_ms")
    one_line(run_refused("--config", str(path), cwd=tmp_path,
                         env=clean_env(BLOCKD_POOL_BLOCK_SIZE="12")),
             "pool.block_size from $BLOCKD_POOL_BLOCK_SIZE: must be a power of two")
    one_line(run_refused("--pool-fence-poll-ms", "4", "--pool-fence-poll-max-ms", "1",
                         cwd=tmp_path),
             "pool.fence_poll_max_ms from --pool-fence-poll-max-ms: must be at least "
             "fence_poll_ms (4.0), got 1.0")


def test_unknown_keys_and_bad_yaml_are_refused_with_a_suggestion(tmp_path: Path) -> None:
    path = tmp_path / "blockd.yaml"
    path.write_text("pool:\n  num_block: 16\n")
    one_line(run_refused("--config", str(path), cwd=tmp_path),
             "pool.num_block: unknown field in", "did you mean pool.num_blocks?")
    path.write_text("pools: {}\n")
    one_line(run_refused("--config", str(path), cwd=tmp_path), "did you mean pool?")
    path.write_text("pool: [1,\n")
    one_line(run_refused("--config", str(path), cwd=tmp_path), "is not valid YAML at line")


def test_values_are_converted_strictly() -> None:
    for env, field in [({"BLOCKD_POOL_NUM_BLOCKS": "16.5"}, "pool.num_blocks"),
                       ({"BLOCKD_POOL_PREFAULT": "maybe"}, "pool.prefault"),
                       ({"BLOCKD_SERVER_GRACE_SECONDS": "nan"}, "server.grace_seconds"),
                       ({"BLOCKD_SERVER_TCP_ADDRESS": "localhost"}, "server.tcp_address"),
                       ({"BLOCKD_METRICS_ADDRESS": "127.0.0.1:70000"}, "metrics.address"),
                       ({"BLOCKD_LOG_FORMAT": "text"}, "log.format"),
                       ({"BLOCKD_SERVER_UNIX_SOCKET": "/" + "x" * 120}, "server.unix_socket")]:
        with pytest.raises(InvalidArgument) as info:
            config.load(None, environ=env)
        assert info.value.field == field and info.value.message.startswith(field)
    ns = argparse.Namespace(config=None, cfg__pool__num_blocks="0x20")
    assert config.load(ns, environ={"BLOCKD_POOL_PREFAULT": "yes"}).pool.num_blocks == 32


def test_relative_socket_paths_become_absolute(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.chdir(tmp_path)
    cfg = config.load(None, environ={"BLOCKD_SERVER_UNIX_SOCKET": "run/b.sock"})
    assert cfg.server.unix_socket == str(tmp_path / "run" / "b.sock")


# -- the default socket paths -----------------------------------------------------------------

def test_default_sockets_are_absolute_and_per_user(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    run = tmp_path / f"blockd-{os.getuid()}"
    assert config.runtime_dir() == run
    assert config.default_unix_socket() == str(run / "blockd.sock")
    assert config.default_handle_socket() == str(run / "blockd-pool.sock")
    assert config.Config().server.unix_socket == config.default_unix_socket()
    monkeypatch.setenv("XDG_RUNTIME_DIR", "relative/dir")  # not absolute: ignored
    assert config.runtime_dir() == Path(f"/tmp/blockd-{os.getuid()}")
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert config.runtime_dir() == Path(f"/tmp/blockd-{os.getuid()}")


def test_the_runtime_directory_is_created_private_and_checked(tmp_path: Path) -> None:
    xdg = tmp_path / "xdg"
    xdg.mkdir()
    env = clean_env(XDG_RUNTIME_DIR=str(xdg))
    base = ["--server-tcp-address", "", "--metrics-address", "", "--pool-num-blocks", "16",
            "--pool-num-layers", "1"]
    run = xdg / f"blockd-{os.getuid()}"
    with Served(*base, cwd=tmp_path, env=env) as d:
        assert d.endpoints["unix"] == str(run / "blockd.sock")
        assert d.endpoints["handles"] == str(run / "blockd-pool.sock")
        assert (run.stat().st_mode & 0o777) == 0o700
        assert answers(d.endpoints["unix"])
    assert sorted(os.listdir(run)) == []  # a clean stop removes the sockets and locks
    run.chmod(0o755)
    one_line(run_refused(*base, cwd=tmp_path, env=env), "cannot start",
             "server.unix_socket", "is open to other users", "chmod 700")
    run.chmod(0o700)
    if os.getuid() == 0:  # only root can give the directory to someone else
        os.chown(run, 4242, -1)
        one_line(run_refused(*base, cwd=tmp_path, env=env),
                 "belongs to uid 4242, not to this user")
    assert os.listdir(run) == []


# -- endpoints in use: refused in one line, nothing left behind -------------------------------

def _listing(path: Path) -> list[str]:
    return sorted(os.listdir(path))


@pytest.mark.parametrize("field", ["server.tcp_address", "metrics.address"])
def test_a_port_in_use_is_refused_and_leaves_nothing_behind(tmp_path: Path, field: str) -> None:
    taken = listening_port()
    try:
        port = taken.getsockname()[1]
        section, name = field.split(".")
        cfg = write_config(tmp_path, **{section: {name: f"127.0.0.1:{port}"}})
        before = _listing(tmp_path)
        one_line(run_refused("--config", str(cfg), cwd=tmp_path), "level=error",
                 'msg="cannot start"', f"field={field}", f"127.0.0.1:{port} is already in use")
        assert _listing(tmp_path) == before  # no socket, no lock file
    finally:
        taken.close()


def test_a_zmq_endpoint_in_use_is_refused_and_leaves_nothing_behind(tmp_path: Path) -> None:
    taken = listening_port()
    try:
        port = taken.getsockname()[1]
        cfg = write_config(tmp_path, events={"zmq_endpoint": f"tcp://127.0.0.1:{port}",
                                             "topic": "kv-test"})
        before = _listing(tmp_path)
        one_line(run_refused("--config", str(cfg), cwd=tmp_path), 'msg="cannot start"',
                 "events.zmq_endpoint")
        assert _listing(tmp_path) == before
    finally:
        taken.close()


def test_a_missing_tenants_file_is_refused_in_one_line(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, tenants={"file": str(tmp_path / "tenants.yaml")})
    before = _listing(tmp_path)
    one_line(run_refused("--config", str(cfg), cwd=tmp_path), "field=tenants.file",
             "No such file")
    assert _listing(tmp_path) == before


@pytest.mark.parametrize("shared", ["both", "unix_socket", "handle_socket"])
def test_a_second_daemon_never_takes_over_a_live_daemons_socket(tmp_path: Path, shared: str
                                                               ) -> None:
    first = write_config(tmp_path / "first")
    second_paths = {"unix_socket": str(tmp_path / "second" / "blockd.sock"),
                    "handle_socket": str(tmp_path / "second" / "pool.sock")}
    for name in ("unix_socket", "handle_socket"):
        if shared in ("both", name):
            second_paths[name] = str(tmp_path / "first" / ("blockd.sock" if name == "unix_socket"
                                                           else "pool.sock"))
    second = write_config(tmp_path / "second", server=second_paths)
    field = "server.unix_socket" if shared != "handle_socket" else "server.handle_socket"
    with Served("--config", str(first), cwd=tmp_path / "first") as d:
        before = _listing(tmp_path / "first")
        assert "blockd.sock" in before and "blockd.sock.lock" in before
        line = one_line(run_refused("--config", str(second), cwd=tmp_path / "second"),
                        f"field={field}", "is in use by a running blockd",
                        f"pid {d.proc.pid}")
        assert "Traceback" not in line
        assert _listing(tmp_path / "first") == before  # nothing of the first's was touched
        assert _listing(tmp_path / "second") == ["blockd.yaml"]  # nor left of the second's
        assert answers(d.endpoints["unix"])  # the first daemon still serves
        assert d.stop() == 0
    assert _listing(tmp_path / "first") == ["blockd.yaml"] + [
        n for n in before if n.startswith("stderr-")]


def test_a_second_daemon_on_the_same_state_dir_is_refused(tmp_path: Path) -> None:
    """Two daemons on one state.dir (other sockets) would append to one journal and map one
    pool: the second refuses, the first keeps serving; after the first dies by SIGKILL the
    directory is free again (the kernel dropped the lock)."""
    state = tmp_path / "state"
    first = write_config(tmp_path / "first", state={"dir": str(state)})
    second = write_config(tmp_path / "second", state={"dir": str(state)})
    with Served("--config", str(first), cwd=tmp_path / "first") as d:
        before = sorted(p.name for p in state.iterdir())
        one_line(run_refused("--config", str(second), cwd=tmp_path / "second"),
                 "field=state.dir", "is in use by a running blockd", f"pid {d.proc.pid}")
        assert sorted(p.name for p in state.iterdir()) == before
        assert answers(d.endpoints["unix"])
        d.kill()
    with Served("--config", str(second), cwd=tmp_path / "second") as d2:
        assert answers(d2.endpoints["unix"])
        assert d2.stop() == 0


def test_a_dead_daemons_socket_is_reclaimed(tmp_path: Path) -> None:
    cfg = write_config(tmp_path)
    d = Served("--config", str(cfg), cwd=tmp_path)
    d.kill()  # kill -9: the socket and the lock file stay, the lock does not
    assert {"blockd.sock", "blockd.sock.lock", "pool.sock"} <= set(os.listdir(tmp_path))
    with Served("--config", str(cfg), cwd=tmp_path) as again:
        assert answers(again.endpoints["unix"])
        assert "reclaimed a stale socket" in again.stderr()


def test_a_path_that_is_not_a_socket_or_is_held_by_another_program_is_not_taken(
        tmp_path: Path) -> None:
    cfg = write_config(tmp_path)
    sock = tmp_path / "blockd.sock"
    sock.write_text("precious")
    one_line(run_refused("--config", str(cfg), cwd=tmp_path), "field=server.unix_socket",
             "exists and is not a socket")
    assert sock.read_text() == "precious" and not (tmp_path / "blockd.sock.lock").exists()
    sock.unlink()
    other = socket.socket(socket.AF_UNIX)  # a listener that takes no lock (an older blockd)
    try:
        other.bind(str(sock))
        other.listen()
        one_line(run_refused("--config", str(cfg), cwd=tmp_path),
                 "is in use by a process that does not hold")
        assert sock.exists()
    finally:
        other.close()


# -- unknown BLOCKD_* variables ---------------------------------------------------------------

def test_unknown_environment_variables_are_found_with_a_suggestion() -> None:
    env = {"BLOCKD_POOL_NUM_BLOCK": "1", "BLOCKD_FROBNICATE": "1", "BLOCKD_POOL_NUM_BLOCKS": "2",
           "BLOCKD_TARGET": "unix:/x", "BLOCKD_TOKEN": "t", "PATH": "/bin"}
    assert config.unknown_env(env) == [("BLOCKD_FROBNICATE", ""),
                                       ("BLOCKD_POOL_NUM_BLOCK", "BLOCKD_POOL_NUM_BLOCKS")]
