"""``blockd_client`` credentials from a token file (a Kubernetes projected Secret), against a
real daemon with a tenants file: read once at construction, re-read when the daemon answers
UNAUTHENTICATED, so rotating the Secret and the tenants file needs no worker restart.

The Secret volume is reproduced as the kubelet writes it (its AtomicWriter): the file is a
symlink into ``..data``, itself a symlink to a timestamped directory that is swapped in one
rename, so a reader sees the old token or the new one, never a partial file.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml
from daemon_proc import LAYOUT as PB_LAYOUT
from daemon_proc import TENANTS, TOKENS, Daemon, md, start

import blockd_client.requests as rq
from blockd.api.v1 import blockd_pb2 as pb
from blockd.runtime.tenants_file import token_hash
from blockd_apps import loadgen
from blockd_client import AsyncClient, BlockdError, Client
from blockd_client.retry import MAX_TOKEN_BYTES, TOKEN_FILE_ENV
from blockd_gpu import KvLayout

LAYOUT = KvLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16")
NS = rq.namespace("tiny", model_revision="r1")
NEW_ALICE = "tok-alice-rotated"


class ProjectedSecret:
    """A Secret volume with one key, laid out and updated like the kubelet's."""

    def __init__(self, root: Path, key: str = "token") -> None:
        self.root = root
        self.key = key
        self.version = 0
        root.mkdir(parents=True)
        (root / key).symlink_to(f"..data/{key}")

    @property
    def path(self) -> Path:
        return self.root / self.key

    def write(self, content: str) -> None:
        self.version += 1
        data = self.root / f"..{self.version:04d}"
        data.mkdir()
        (data / self.key).write_text(content)
        tmp = self.root / "..data_tmp"
        tmp.symlink_to(data.name)
        os.replace(tmp, self.root / "..data")  # one rename: the old content or the new


def secret(tmp_path: Path, content: str) -> ProjectedSecret:
    s = ProjectedSecret(tmp_path / "secret")
    s.write(content)
    return s


def sessions(d: Daemon) -> int:
    return d.stub().Stats(pb.StatsRequest(), metadata=md("admin")).num_sessions


def rotate_alice(d: Daemon, token: str = NEW_ALICE) -> None:
    """The operator's side: alice's hash replaced in the tenants file, SIGHUP; returns once the
    daemon accepts the new token (polled with a call, not by reading its log)."""
    tenants = yaml.safe_load(yaml.safe_dump(TENANTS))
    for w in tenants["workers"]:
        if w["name"] == "alice":
            w["token_sha256"] = token_hash(token)
    d.tenants_path.write_text(yaml.safe_dump(tenants))
    d.signal(signal.SIGHUP)
    stub = d.stub()
    deadline = time.monotonic() + 10
    while True:
        try:
            stub.Stats(pb.StatsRequest(), metadata=(("authorization", f"Bearer {token}"),))
            return
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAUTHENTICATED, exc
            assert time.monotonic() < deadline, "the daemon never accepted the rotated token"
            time.sleep(0.05)


def target(d: Daemon) -> str:
    return f"unix:{d.endpoints['unix']}"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon whose tenants file no test here changes."""
    d = start(tmp_path_factory.mktemp("blockd"))
    yield d
    d.stop()


@pytest.fixture
def rotating(tmp_path: Path) -> Iterator[Daemon]:
    """A daemon of its own for a test that rotates alice's token."""
    d = start(tmp_path / "blockd")
    yield d
    d.stop()


# -- reading the file ----------------------------------------------------------------------------

def test_a_token_file_authenticates_and_its_newline_is_not_part_of_the_token(
        daemon: Daemon, tmp_path: Path) -> None:
    s = secret(tmp_path, TOKENS["alice"] + "\n")  # kubectl create secret --from-file keeps it
    with Client(target(daemon), token_file=s.path) as c:
        assert [t.tenant_id for t in c.stats().tenants] == ["acme"]
        session = c.attach("acme", LAYOUT, worker_name="alice", map_pool=False, stream=True)
        out = session.step([rq.admit([1, 2, 3, 4, 5], NS)])
        assert out.results[0].status.code == 0
        assert session.detach() == 1


def test_the_environment_names_the_file_only_when_no_credential_is_given(
        daemon: Daemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = secret(tmp_path, TOKENS["alice"])
    monkeypatch.setenv(TOKEN_FILE_ENV, str(s.path))
    with Client(target(daemon)) as c:
        assert [t.tenant_id for t in c.stats().tenants] == ["acme"]
    with Client(target(daemon), token=TOKENS["bob"]) as c:  # an explicit token wins
        assert [t.tenant_id for t in c.stats().tenants] == ["globex"]
    monkeypatch.setenv(TOKEN_FILE_ENV, "")  # set but empty: no file, an anonymous caller
    with Client(target(daemon)) as c, pytest.raises(BlockdError) as info:
        c.stats()
    assert info.value.status == grpc.StatusCode.UNAUTHENTICATED


BAD_FILES = {
    "missing": (None, "cannot read it"),
    "empty": (b"", "empty"),
    "blank": (b"  \n\n", "empty"),
    "two words": (b"tok-alice tok-bob\n", "one word of printable ASCII"),
    "inner newline": (b"tok-\nalice", "one word of printable ASCII"),
    "not ascii": ("tok-älice".encode(), "one word of printable ASCII"),
    "control character": (b"tok-\x00alice", "one word of printable ASCII"),
    "too large": (b"x" * (MAX_TOKEN_BYTES + 1), f"larger than {MAX_TOKEN_BYTES} bytes"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_a_bad_token_file_fails_the_constructor_naming_field_and_path(
        daemon: Daemon, tmp_path: Path, case: str) -> None:
    content, why = BAD_FILES[case]
    path = tmp_path / "token"
    if content is not None:
        path.write_bytes(content)
    before = sessions(daemon)
    for cls in (Client, AsyncClient):
        with pytest.raises(ValueError) as info:
            cls(target(daemon), token_file=path)
        assert str(info.value).startswith(f"token_file: {path}: "), info.value
        assert why in str(info.value)
    assert sessions(daemon) == before


def test_a_directory_is_not_a_token_file(daemon: Daemon, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"^token_file: {tmp_path}: cannot read it"):
        Client(target(daemon), token_file=tmp_path)


def test_a_token_and_a_token_file_exclude_each_other(daemon: Daemon, tmp_path: Path) -> None:
    s = secret(tmp_path, TOKENS["alice"])
    before = sessions(daemon)
    with pytest.raises(ValueError, match="^token_file: give a token or a token_file, not both"):
        Client(target(daemon), token=TOKENS["alice"], token_file=s.path)
    assert sessions(daemon) == before


def test_the_file_is_read_once_not_per_call(daemon: Daemon, tmp_path: Path) -> None:
    """The file changing alone changes nothing: the daemon still accepts the token in use."""
    s = secret(tmp_path, TOKENS["alice"])
    with Client(target(daemon), token_file=s.path) as c:
        s.write(TOKENS["bob"])
        for _ in range(3):
            assert [t.tenant_id for t in c.stats().tenants] == ["acme"]
        s.path.unlink()
        assert [t.tenant_id for t in c.stats().tenants] == ["acme"]


def test_a_token_still_refused_after_rereading_is_unauthenticated_and_changes_nothing(
        daemon: Daemon, tmp_path: Path) -> None:
    s = secret(tmp_path, "tok-nobody-knows")
    before = sessions(daemon)
    with Client(target(daemon), token_file=s.path) as c:
        with pytest.raises(BlockdError) as info:
            c.attach("acme", LAYOUT, map_pool=False)
        assert info.value.status == grpc.StatusCode.UNAUTHENTICATED
        assert info.value.field == "authorization"
    assert sessions(daemon) == before


# -- rotation --------------------------------------------------------------------------------------

def test_a_rotated_secret_is_picked_up_when_the_old_token_is_refused(
        rotating: Daemon, tmp_path: Path) -> None:
    d = rotating
    s = secret(tmp_path, TOKENS["alice"])
    with Client(target(d), token_file=s.path) as c, \
            Client(target(d), token=TOKENS["alice"]) as fixed:
        streamed = c.attach("acme", LAYOUT, worker_name="alice", map_pool=False, stream=True)
        unary = c.attach("acme", LAYOUT, worker_name="alice", map_pool=False)
        seq = streamed.step([rq.admit([1, 2, 3, 4, 5], NS)]).results[0].admit.sequence_id
        assert streamed.streamer is not None and streamed.streamer.opened == 1
        # 1. The kubelet projects the new Secret: nothing changes yet (the old token works).
        s.write(NEW_ALICE + "\n")
        assert streamed.step([rq.append(seq, [6])]).results[0].append.num_tokens == 6
        # 2. The tenants file is rotated: the old token is refused from now on.
        rotate_alice(d)
        with pytest.raises(BlockdError) as info:
            fixed.stats()
        assert info.value.status == grpc.StatusCode.UNAUTHENTICATED  # the control
        # 3. The file-based client re-reads on the refusal, on its open stream first...
        out = streamed.step([rq.append(seq, [7])])
        assert out.results[0].append.num_tokens == 7
        assert streamed.streamer.opened == 2  # one fresh stream with the new token
        # ... and on unary calls: same sessions, same epoch, nothing re-attached.
        assert unary.heartbeat().lease_expires_unix_ms > 0
        assert [t.tenant_id for t in c.stats().tenants] == ["acme"]
        assert sessions(d) == 2
        assert streamed.detach() == 1 and unary.detach() == 0


def test_an_unreadable_file_on_reread_keeps_the_old_token_until_it_is_back(
        rotating: Daemon, tmp_path: Path) -> None:
    d = rotating
    s = secret(tmp_path, TOKENS["alice"])
    with Client(target(d), token_file=s.path) as c:
        session = c.attach("acme", LAYOUT, worker_name="alice", map_pool=False)
        rotate_alice(d)
        s.write("")  # a broken projection: the re-read fails, the old token is kept
        with pytest.raises(BlockdError) as info:
            session.heartbeat()
        assert info.value.status == grpc.StatusCode.UNAUTHENTICATED
        s.write(NEW_ALICE)
        assert session.heartbeat().lease_expires_unix_ms > 0
        assert session.detach() == 0


def test_the_async_client_rereads_too(rotating: Daemon, tmp_path: Path) -> None:
    d = rotating
    s = secret(tmp_path, TOKENS["alice"])

    async def run() -> tuple[str, str]:
        c = AsyncClient(target(d), token_file=s.path)
        try:
            session = await c.attach("acme", LAYOUT, worker_name="alice", map_pool=False)
            before = (await c.stats()).tenants[0].tenant_id
            s.write(NEW_ALICE)
            await asyncio.to_thread(rotate_alice, d)
            out = await session.step([rq.admit([1, 2, 3], NS)])
            assert out.results[0].status.code == 0
            after = (await c.stats()).tenants[0].tenant_id
            await session.detach()
            return before, after
        finally:
            await c.close()

    assert asyncio.run(run()) == ("acme", "acme")


# -- the load generator's flag -------------------------------------------------------------------

def test_loadgen_takes_its_token_from_a_file(daemon: Daemon, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(SystemExit) as info:
        loadgen.main(["--target", target(daemon), "--token-file", str(missing)])
    assert info.value.code == 2
    assert f"token_file: {missing}: cannot read it" in capsys.readouterr().err
    s = secret(tmp_path, TOKENS["alice"] + "\n")
    layout = ('{"block_size": 4, "num_layers": 2, "num_kv_heads": 2, "head_dim": 8, '
              f'"dtype": {PB_LAYOUT.dtype}, "kv_order": {PB_LAYOUT.kv_order}, "tp_size": 1}}')
    rc = loadgen.main(["--target", target(daemon), "--token", "tok-wrong", "--token-file",
                       str(s.path), "--tenant", "acme", "--workers", "1", "--seqs", "2",
                       "--duration", "0.5", "--layout", layout, "--progress", "0", "--json"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert '"workers_finished": 1' in out
