"""blockctl against a real daemon: tables by default, JSON with --json; --version; finding the
daemon from any directory; one clear line when no daemon answers."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import yaml
from daemon_proc import TOKENS, Worker, append, commit

import blockd
from blockd import config
from blockd.api.v1 import blockd_pb2 as pb
from blockd_apps.launch import spawn


def ctl(daemon, *args: str, token: str = "admin", check: bool = True):  # type: ignore[no-untyped-def]
    # The token as docs/operations.md shows it: piped in, never on the command line.
    cmd = [sys.executable, "-m", "blockd_apps.ctl", "--target", f"unix:{daemon.endpoints['unix']}",
           "--token-file", "/dev/stdin", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=check,
                          input=TOKENS[token])


def test_stats_tenants_inspect_watch_flush(daemon) -> None:  # type: ignore[no-untyped-def]
    # A lease no run of blockctl outlasts (each is a new Python process: seconds apiece on a
    # loaded machine, while this session sends nothing; the default 10 s ran out in a full
    # suite and the release below met an expired session).
    w = Worker(daemon.stub("unix"), "carol", "initech", lease_ms=300_000)
    a = w.admit([811, 812, 813, 814, 815, 816])
    w.step(commit(a.sequence_id), append(a.sequence_id, [817]))
    w.step(completed=w.fence)

    out = ctl(daemon, "stats").stdout
    assert "free" in out and "cached" in out and "prefix cache" in out
    stats = json.loads(ctl(daemon, "--json", "stats").stdout)
    assert stats["num_blocks"] == "64"  # uint64 as a JSON string, the proto3 JSON mapping

    tenants = json.loads(ctl(daemon, "--json", "tenants").stdout)
    assert {t["tenant_id"] for t in tenants} >= {"acme", "initech"}
    assert "initech" in ctl(daemon, "tenants").stdout

    # The seeds' debugging step 1: every position's block, offset, physical block and slot.
    out = ctl(daemon, "inspect", a.sequence_id).stdout
    lines = [line.split() for line in out.splitlines()[3:]]
    assert len(lines) == 7
    table = list(a.block_table)
    for pos, _lb, off, pb_, slot, *_ in lines:
        assert int(pb_) == table[int(pos) // 4] and int(slot) == int(pb_) * 4 + int(off)
    js = json.loads(ctl(daemon, "--json", "inspect", a.sequence_id).stdout)
    assert len(js["positions"]) == 7

    events = ctl(daemon, "--json", "watch", "--since", "1", "--limit", "1").stdout
    first = json.loads(events.splitlines()[0])
    assert first["sequence_number"] == "1"
    # One printed form of a block hash (#28 finding 10): text and --json print the unsigned
    # 64-bit integer the ZMQ stream sends (the key's first 8 bytes, big-endian).
    stored = first["block_stored"]
    key = bytes.fromhex(stored["block_keys"][0])
    assert stored["block_hashes"] == [int.from_bytes(key[:8], "big")]
    text = ctl(daemon, "watch", "--since", "1", "--limit", "1").stdout.split()
    assert text[:3] == ["1", "block_stored", str(stored["block_hashes"][0])]

    # "held of quota" leaves the evictable cached blocks out (#28 finding 10): once the
    # sequence is released, initech holds nothing and its committed block is only cached.
    w.step(pb.Operation(release=pb.ReleaseOp(sequence_id=a.sequence_id)))
    w.step(completed=w.fence)
    lines = ctl(daemon, "tenants").stdout.splitlines()
    assert lines[0].split()[:3] == ["tenant", "held", "cached"] and "held of quota" in lines[0]
    row = next(line.split() for line in lines if line.split()[:1] == ["initech"])
    assert row[1] == "0" and int(row[2]) >= 1 and row[-1] == "0%", lines

    out = ctl(daemon, "flush", "--tenant", "initech").stdout
    assert out.startswith("flushed ") and out.strip().endswith("of tenant initech")

    # Errors: one clear line and exit 1 when the daemon refuses.
    bad = ctl(daemon, "flush", "--model-id", "tiny", "--tenant", "acme", token="bob", check=False)
    assert bad.returncode == 1 and bad.stderr.startswith("blockctl: PERMISSION_DENIED: tenant_id")
    bad = ctl(daemon, "inspect", "no-such-seq", check=False)
    assert bad.returncode == 1 and "NOT_FOUND" in bad.stderr
    for out in (bad, ctl(daemon, "sequences", "--tenant", "acme", token="bob", check=False)):
        assert len(out.stderr.splitlines()) == 1 and "Traceback" not in out.stderr


def test_version() -> None:
    script = Path(sys.executable).with_name("blockctl")  # the console script, if installed
    for cmd in ([sys.executable, "-m", "blockd_apps.ctl"], [str(script)] * script.exists()):
        out = subprocess.run([*cmd, "--version"], capture_output=True, text=True, timeout=30,
                             check=True)
        assert out.stdout.strip() == f"blockctl {blockd.__version__}"


def run_elsewhere(cwd: Path, env: dict[str, str], *args: str
                  ) -> subprocess.CompletedProcess[str]:
    """blockctl in ``cwd`` with exactly ``env`` (plus PATH): no --target."""
    return subprocess.run([sys.executable, "-m", "blockd_apps.ctl", *args], cwd=cwd,
                          env={"PATH": "/usr/bin:/bin", **env}, capture_output=True, text=True,
                          timeout=30)


def test_finds_the_daemon_from_any_directory(daemon, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    sock = daemon.endpoints["unix"]
    elsewhere = tmp_path / "somewhere" / "else"
    elsewhere.mkdir(parents=True)
    assert not (elsewhere / "run").exists()
    token = {"BLOCKD_TOKEN": TOKENS["admin"]}
    # $BLOCKD_TARGET, and the daemon's own variable for its socket, both work from anywhere.
    for env in ({"BLOCKD_TARGET": f"unix:{sock}"}, {"BLOCKD_SERVER_UNIX_SOCKET": sock}):
        out = run_elsewhere(elsewhere, {**env, **token}, "--json", "stats")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["num_blocks"] == "64"


def test_the_default_target_is_the_daemons_default_socket(tmp_path: Path,
                                                          monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A daemon started without a socket setting, blockctl without a target, in different
    directories, the same environment: they meet at the daemon's absolute default path."""
    runtime = tmp_path / "xdg"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    default = config.default_unix_socket()
    assert os.path.isabs(default) and default.startswith(str(runtime))
    workdir = tmp_path / "daemon"
    workdir.mkdir()
    cfg = workdir / "blockd.yaml"
    cfg.write_text(yaml.safe_dump({
        "server": {"tcp_address": "", "grace_seconds": 0.5},
        "metrics": {"address": ""},
        "pool": {"block_size": 4, "num_blocks": 16, "num_layers": 1, "num_kv_heads": 1,
                 "head_dim": 8}}))
    launched = spawn(cfg, workdir)
    try:
        assert launched.endpoints["unix"] == default
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        env = {"XDG_RUNTIME_DIR": str(runtime)}
        out = run_elsewhere(elsewhere, env, "--help")
        assert f"unix:{default}" in "".join(out.stdout.split())  # argparse wraps at hyphens
        out = run_elsewhere(elsewhere, env, "--json", "stats")  # anonymous: the laptop default
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["num_blocks"] == "16"
    finally:
        assert launched.stop() == 0


def test_says_so_in_one_line_when_no_daemon_is_running(tmp_path: Path) -> None:
    stale = tmp_path / "stale.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(stale))  # a socket file nobody listens on: a daemon that died
    listener.close()
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()  # nothing listens there
    for target, why in ((f"unix:{tmp_path / 'none.sock'}", "no socket there"),
                        (f"unix:{stale}", "onnection refused"),
                        (f"127.0.0.1:{port}", "onnection refused")):
        for env, args in (({"BLOCKD_TARGET": target}, ("stats",)),
                          ({}, ("--target", target, "sequences"))):
            out = run_elsewhere(tmp_path, env, *args)
            assert out.returncode == 2, (target, out.stderr)
            assert out.stdout == "" and len(out.stderr.splitlines()) == 1, out.stderr
            line = out.stderr.strip()
            assert line.startswith(f"blockctl: no blockd is answering at {target} (")
            assert why in line and "blockd serve" in line and "Traceback" not in line
