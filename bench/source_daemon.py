"""A daemon started from a given source tree, for before/after benchmarks run in one process.

The before/after benchmarks (bench/metrics_scrape.py, bench/replay_flood.py,
bench/hardening_ab.py) start ``blockd serve`` from an older tree and from this one in the same
run: the daemon subprocess gets that tree first on its ``PYTHONPATH`` (``pythonpath``), so it
runs that tree's code with this virtualenv's packages, while the client side (this process)
is always this tree's. ``git_tree`` checks a commit out into a temporary directory (a
``git worktree``) for that, or says it cannot (a shallow clone without the commit).

Also the small pieces those benchmarks share: the layout and namespace they attach with, the
tenants file of workers ``w-<tenant>`` with token ``tok-<tenant>``, a session driver, a
scrape of /metrics, the daemon's CPU time from ``/proc``, and percentiles and spreads.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import shutil
import statistics
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import yaml

from blockd.api.v1 import blockd_pb2 as pb
from blockd.api.v1 import blockd_pb2_grpc as pb_grpc
from blockd.runtime.tenants_file import token_hash
from blockd_apps.launch import Launched, spawn, terminate

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = pb.KvLayout(block_size=4, num_layers=1, num_kv_heads=1, head_dim=8,
                     dtype=pb.KV_DTYPE_FLOAT16, kv_order=pb.KV_ORDER_BLOCK_TOKEN_HEAD_DIM,
                     tp_size=1)
NS = pb.CacheNamespace(model_id="bench", model_revision="r1")
#: The pool every daemon here has, LAYOUT's shape (``num_blocks`` added per benchmark).
POOL = {"block_size": 4, "num_layers": 1, "num_kv_heads": 1, "head_dim": 8,
        "dtype": "float16"}


def pythonpath(source: Path) -> str:
    """The ``PYTHONPATH`` that makes a daemon run ``source``'s packages."""
    return os.pathsep.join(str(source / p) for p in ("", "apps", "clients", "gpu"))


@contextlib.contextmanager
def daemon(source: Path, config: Path, work: Path, *, ready_timeout: float = 120,
           preexec_fn: Callable[[], object] | None = None) -> Iterator[Launched]:
    """``blockd serve --config CONFIG`` of the tree ``source``, stopped on leaving."""
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = pythonpath(source)
    try:
        launched = spawn(config, work, ready_timeout=ready_timeout, preexec_fn=preexec_fn)
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before
    try:
        yield launched
    finally:
        terminate(launched.proc)


@contextlib.contextmanager
def git_tree(commit: str) -> Iterator[Path | None]:
    """``commit`` of this repository checked out in a temporary directory (a detached
    ``git worktree``, removed on leaving), or None where the commit is not in the clone."""
    known = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"],
                           capture_output=True, check=False)
    if known.returncode != 0:
        yield None
        return
    tmp = Path(tempfile.mkdtemp(prefix="blockd-before-"))
    tree = tmp / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), commit],
                   capture_output=True, check=True)
    try:
        yield tree
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                       capture_output=True, check=False)
        shutil.rmtree(tmp, ignore_errors=True)


def write_tenants(work: Path, tenants: Sequence[dict[str, Any]]) -> Path:
    """A tenants file: the given tenants, each with its worker ``w-<id>`` (token ``tok-<id>``)."""
    workers = [{"name": f"w-{t['id']}", "token_sha256": token_hash(f"tok-{t['id']}"),
                "tenants": [t["id"]]} for t in tenants]
    path = work / "tenants.yaml"
    path.write_text(yaml.safe_dump({"tenants": list(tenants), "workers": workers}))
    return path


def write_config(work: Path, tenants: Sequence[dict[str, Any]], num_blocks: int,
                 **sections: dict[str, Any]) -> Path:
    """blockd.yaml in ``work``: Unix sockets there, metrics on a kernel-chosen port, the pool
    (POOL, ``num_blocks``), ``tenants`` only; each of ``sections`` merged over its section."""
    cfg: dict[str, dict[str, Any]] = {
        "server": {"unix_socket": str(work / "b.sock"), "tcp_address": "",
                   "handle_socket": str(work / "h.sock")},
        "metrics": {"address": "127.0.0.1:0"},
        "pool": {**POOL, "num_blocks": num_blocks},
        "tenants": {"file": str(write_tenants(work, tenants)), "allow_anonymous": False}}
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    path = work / "blockd.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def md(tenant: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer tok-{tenant}"),)


class Session:
    """One attached session of ``tenant`` (worker ``w-<tenant>``): numbered Steps."""

    def __init__(self, stub: pb_grpc.BlockdServiceStub, tenant: str,
                 layout: pb.KvLayout = LAYOUT) -> None:
        self.stub, self.md = stub, md(tenant)
        att = stub.Attach(pb.AttachRequest(worker_name=f"w-{tenant}", tenant_id=tenant,
                                           layout=layout), metadata=self.md)
        self.sid, self.epoch, self.step_id, self.fence = att.session_id, att.epoch, 0, 0

    def step(self, ops: list[pb.Operation], fence: int = 0, completed: int = 0
             ) -> pb.StepResponse:
        self.step_id += 1
        resp: pb.StepResponse = self.stub.Step(pb.StepRequest(
            session_id=self.sid, epoch=self.epoch, step_id=self.step_id, fence=fence,
            completed_fence=completed, operations=ops), metadata=self.md)
        return resp

    def heartbeat(self) -> None:
        """Renews the lease (a caller that waits on something else keeps its session)."""
        self.stub.Heartbeat(pb.HeartbeatRequest(session_id=self.sid, epoch=self.epoch),
                            metadata=self.md)


def admit(tokens: Sequence[int]) -> pb.Operation:
    return pb.Operation(admit=pb.AdmitOp(namespace=NS, token_ids=tokens))


def release(sequence_id: str) -> pb.Operation:
    return pb.Operation(release=pb.ReleaseOp(sequence_id=sequence_id))


def channel(launched: Launched) -> grpc.Channel:
    return grpc.insecure_channel(f"unix:{launched.endpoints['unix']}")


def metrics(address: str, prefix: str = "blockd_") -> dict[str, float]:
    """The samples of one GET /metrics at ``address`` whose names start with ``prefix``
    (labels kept in the key: ``name{tenant="a"}``)."""
    host, _, port = address.rpartition(":")
    c = http.client.HTTPConnection(host, int(port), timeout=30)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    c.close()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(prefix)}


def cpu_seconds(pid: int) -> float:
    """The process's user + system CPU time (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ms(xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (seconds), in milliseconds (nearest rank)."""
    return 1000 * sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def spread(xs: Sequence[float]) -> dict[str, float]:
    """Median, minimum and maximum."""
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}
