"""The attacks of bench/hardening_ab.py (issue 28, findings 1, 2, 4 and 7), one function each.

Each ``attack_*(source, side, args)`` starts a fresh daemon of the tree ``source`` (its own
code, this virtualenv: bench/source_daemon.py), on CPU 0, runs its attack from this process
(and helper processes on CPU 1), stops the daemon and returns one row of figures. What each
attack does and which figure is compared is in bench/hardening_ab.py's docstring.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))

import metrics_scrape  # noqa: E402
from source_daemon import (  # noqa: E402
    Session,
    admit,
    channel,
    cpu_seconds,
    daemon,
    metrics,
    ms,
    release,
    write_config,
)

from blockd.api.v1 import blockd_pb2 as pb  # noqa: E402
from blockd.api.v1 import blockd_pb2_grpc as pb_grpc  # noqa: E402

#: The sessions' lease: longer than any phase, so no session expires while it waits its turn.
LEASE_MS = 300_000


def _placed(extra: Callable[[], None] | None = None) -> Callable[[], None]:
    """The daemon's preexec: on CPU 0, then ``extra`` (e.g. a lower RLIMIT_NOFILE)."""
    def run() -> None:
        os.sched_setaffinity(0, {0})
        if extra is not None:
            extra()
    return run


def _idle() -> None:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def _code(exc: grpc.RpcError) -> str:
    return f"{exc.code().name}: {(exc.details() or '')[:160]}"


# 1. Sessions cost file descriptors -------------------------------------------------------

def _fitting_sessions(nofile: int, tenants: list[str]) -> int:
    """The largest ``server.max_sessions`` this tree's descriptor budget accepts at ``nofile``
    (blockd.runtime.fds, as tests/security/test_fds.py sizes it)."""
    from blockd.config import Config, ServerConfig
    from blockd.core.tenants import TenantPolicy
    from blockd.runtime import fds

    policies = [TenantPolicy(tenant_id=t, quota_blocks=32) for t in tenants]
    for n in range(nofile // 2, 0, -1):
        cfg = Config(server=ServerConfig(max_sessions=n))
        if fds.FdBudget(nofile, fds.reserve(cfg, policies, partitions=1)).sessions >= n:
            return n
    raise SystemExit(f"--nofile {nofile} allows no session")


def _attach_until_refused(stub: pb_grpc.BlockdServiceStub, tenant: str, most: int
                          ) -> tuple[list[Session], str | None]:
    got: list[Session] = []
    for _ in range(most):
        try:
            got.append(Session(stub, tenant))
        except grpc.RpcError as exc:
            return got, _code(exc)
    return got, None


def attack_fds(source: Path, side: str, args: argparse.Namespace) -> dict[str, Any]:
    tenants = [{"id": "fd-a", "quota_blocks": 32}, {"id": "fd-b", "quota_blocks": 32}]
    nofile = args.nofile

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    row: dict[str, Any] = {"nofile": nofile, "tenant_max_sessions": 256}
    with tempfile.TemporaryDirectory(prefix="blockd-ab-fds-") as tmp:
        work = Path(tmp)
        server: dict[str, Any] = {"grace_seconds": 0.5}
        lease = {"default_ms": LEASE_MS}
        try:
            with daemon(source, write_config(work, tenants, 64, server=server, lease=lease), work,
                        preexec_fn=_placed(limit)) as d:
                row["audit_config_started"] = True
                return {**row, **_fds_run(d, 256, args)}
        except RuntimeError as exc:  # refused at start: this tree's limits check
            lines = [ln for ln in str(exc).splitlines() if "cannot start" in ln]
            row["audit_config_started"] = False
            row["audit_config_refusal"] = lines[0][:400] if lines else str(exc)[-400:]
        server["max_sessions"] = _fitting_sessions(nofile, [t["id"] for t in tenants])
        row["server_max_sessions"] = server["max_sessions"]
        with daemon(source, write_config(work, tenants, 64, server=server, lease=lease), work,
                    preexec_fn=_placed(limit)) as d:
            return {**row, **_fds_run(d, server["max_sessions"] // 2, args)}


def _fds_run(d: Any, entitled: int, args: argparse.Namespace) -> dict[str, Any]:
    """A attaches until refused, then B; B's entitlement is ``entitled`` (its max_sessions,
    or its share of what the descriptors allow where the daemon has shares)."""
    with channel(d) as ch:
        stub = pb_grpc.BlockdServiceStub(ch)
        a, a_refusal = _attach_until_refused(stub, "fd-a", 1024)
        b, b_refusal = _attach_until_refused(stub, "fd-b", 1024)
        # Is the daemon still of use to the tenants' sessions it has?
        try:
            r = a[0].step([admit([1, 2, 3, 4, 5])]).results[0]
            step_after = "OK" if r.status.code == 0 else f"status {r.status.code}"
        except grpc.RpcError as exc:
            step_after = _code(exc)
        fds_open = len(os.listdir(f"/proc/{d.proc.pid}/fd"))
    return {"a_attached": len(a), "a_refusal": a_refusal, "b_attached": len(b),
            "b_refusal": b_refusal, "b_entitled": entitled,
            "b_served_fraction": min(len(b), entitled) / entitled,
            "internal_refusals": sum("INTERNAL" in (x or "") for x in (a_refusal, b_refusal)),
            "a_step_after": step_after, "daemon_open_fds": fds_open}


# 2. Oversized requests -------------------------------------------------------------------

def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def oversized_step(sid: str, epoch: int, size: int) -> bytes:
    """A StepRequest of ``size`` bytes: its session, then an unknown field of padding (the
    cheapest such request for its sender to make)."""
    head = pb.StepRequest(session_id=sid, epoch=epoch, step_id=1).SerializeToString()
    pad = size - len(head) - 2 - len(_varint(size))
    return head + b"\xc2\x3e" + _varint(pad) + bytes(pad)  # field 1000, length-delimited


def flood_oversized(target: str, tenant: str, size: int, seconds: float, idle: bool,
                    out: Any, done: Any) -> None:
    """One flooder process: ``size``-byte Steps back to back for ``seconds``; its connection
    stays open until ``done`` (the daemon's bytes received on it are read meanwhile)."""
    os.sched_setaffinity(0, {1})
    if idle:
        _idle()
    got: Counter[str] = Counter()
    with grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 1 << 26)]
                               ) as ch:
        s = Session(pb_grpc.BlockdServiceStub(ch), tenant)
        raw = oversized_step(s.sid, s.epoch, size)
        call = ch.unary_unary("/blockd.v1.BlockdService/Step")
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                call(raw, metadata=s.md, timeout=30)
                got["OK"] += 1
            except grpc.RpcError as exc:
                got[f"{exc.code().name}: {(exc.details() or '')[:70]}"] += 1
        out[tenant] = dict(got)
        done.wait(120)


def tcp_bytes_received(port: int) -> int:
    """Bytes the sockets of the listener on ``port`` received (``ss``: tcp_info's
    bytes_received of each established connection)."""
    out = subprocess.run(["ss", "-tinH", "state", "established", f"( sport = :{port} )"],
                         capture_output=True, text=True, check=True).stdout
    return sum(int(m) for m in re.findall(r"bytes_received:(\d+)", out))


def _victim(s: Session, until: Callable[[int], bool]) -> list[float]:
    lat, i = [], 0
    while not until(i):
        t0 = time.perf_counter()
        resp = s.step([admit([7, 7, 7, 10_000_000 + i])])
        lat.append(time.perf_counter() - t0)
        s.step([release(resp.results[0].admit.sequence_id)])
        i += 1
    return lat


def attack_oversized(source: Path, side: str, args: argparse.Namespace) -> dict[str, Any]:
    flooders = [f"ov-f{i}" for i in range(args.flooders)]
    tenants = [{"id": t, "quota_blocks": 64} for t in ["ov-v", *flooders]]
    ctx = mp.get_context("spawn")
    cfg = {"server": {"tcp_address": "127.0.0.1:0"},  # the flooders' connections: TCP
           "lease": {"default_ms": LEASE_MS}}
    with tempfile.TemporaryDirectory(prefix="blockd-ab-ov-") as tmp, \
            daemon(source, write_config(Path(tmp), tenants, 1024, **cfg), Path(tmp),
                   preexec_fn=_placed()) as d, channel(d) as ch:
        v = Session(pb_grpc.BlockdServiceStub(ch), "ov-v")
        _victim(v, lambda i: i >= 50)  # warm-up
        alone = _victim(v, lambda i: i >= args.admits)
        manager = ctx.Manager()
        counts, done = manager.dict(), manager.Event()
        target = d.endpoints["tcp"]
        size = int(args.step_mb * 1e6)
        procs = [ctx.Process(target=flood_oversized,
                             args=(target, t, size, args.flood_seconds,
                                   args.flood_sched == "idle", counts, done))
                 for t in flooders]
        cpu0, t0 = cpu_seconds(d.proc.pid), time.monotonic()
        for p in procs:
            p.start()
        time.sleep(min(1.0, args.flood_seconds / 4))  # the flooders start sending
        flooded = _victim(v, lambda i: time.monotonic() > t0 + args.flood_seconds)
        while len(counts) < len(procs) and time.monotonic() < t0 + args.flood_seconds + 60:
            time.sleep(0.05)
        cpu_s, wall = cpu_seconds(d.proc.pid) - cpu0, time.monotonic() - t0
        received = tcp_bytes_received(int(target.rpartition(":")[2]))
        flood_counts = dict(counts)
        done.set()
        for p in procs:
            p.join(60)
        manager.shutdown()
        alone += _victim(v, lambda i: i >= args.admits)
    row: dict[str, Any] = {
        "step_bytes": size, "flooders": args.flooders, "flood_seconds": wall,
        "victim_admits_alone": len(alone), "victim_admits_flooded": len(flooded),
        "victim_p50_ms_alone": ms(alone, 0.5), "victim_p99_ms_alone": ms(alone, 0.99),
        "victim_p50_ms_flooded": ms(flooded, 0.5), "victim_p99_ms_flooded": ms(flooded, 0.99),
        "daemon_bytes_received": received, "daemon_cpu_share": cpu_s / wall,
        "flood_outcomes": flood_counts}
    calls = sum(n for c in flood_counts.values() for n in c.values())
    row["flood_calls"] = calls
    row["bytes_received_per_call"] = received / max(1, calls)
    row["victim_p99_inflation"] = row["victim_p99_ms_flooded"] / row["victim_p99_ms_alone"]
    row["victim_p50_inflation"] = row["victim_p50_ms_flooded"] / row["victim_p50_ms_alone"]
    return row


# 3. One tenant's journal fills state.dir ---------------------------------------------------

@contextlib.contextmanager
def small_fs(where: Path, kib: int) -> Iterator[tuple[Path, str]]:
    """A ``kib`` KiB tmpfs at ``where`` when one can be mounted, else ``where`` as it is."""
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k,mode=0700", "tmpfs",
                           str(where)], capture_output=True, check=False)
    try:
        yield where, (f"tmpfs of {kib} KiB" if done.returncode == 0
                      else "a directory of the temporary file system (no tmpfs could be "
                           "mounted): reserve_bytes set from its free space")
    finally:
        if done.returncode == 0:
            subprocess.run(["umount", "-l", str(where)], check=False)


def _free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _cycle(s: Session, i: int) -> str | None:
    """One admit+release of 10 blocks (39 tokens of 3-byte ids); None, or the refusal."""
    try:
        got = s.step([admit([100_000 + i * 7 + t for t in range(39)])], completed=s.fence)
        r = got.results[0]
        if r.status.code != 0:
            return f"status {r.status.code}: {r.status.message[:160]}"
        s.fence += 1
        out = s.step([release(r.admit.sequence_id)], fence=s.fence).results[0]
        return None if out.status.code == 0 else f"status {out.status.code}: {out.status.message}"
    except grpc.RpcError as exc:
        return _code(exc)


def _other_step(s: Session, i: int) -> str:
    try:
        r = s.step([admit([1 + i, 2, 3, 4, 5])]).results[0]
        if r.status.code == 0:
            s.step([release(r.admit.sequence_id)])
            return "OK"
        return f"status {r.status.code}: {r.status.message[:160]}"
    except grpc.RpcError as exc:
        return _code(exc)


def attack_state_dir(source: Path, side: str, args: argparse.Namespace) -> dict[str, Any]:
    tenants = [{"id": "sd-a", "quota_blocks": 10}, {"id": "sd-b", "quota_blocks": 10}]
    with tempfile.TemporaryDirectory(prefix="blockd-ab-sd-") as tmp, \
            small_fs(Path(tmp) / "fs", args.fs_kib) as (fs, kind):
        work = Path(tmp) / "work"
        work.mkdir()
        state = fs / "state"
        sections = {"lease": {"default_ms": 60_000}, "server": {"grace_seconds": 0.5}}
        probe = {"dir": str(state), "reserve_bytes": 64 * 1024}
        with daemon(source, write_config(work, tenants, 64, state=probe, **sections), work,
                    preexec_fn=_placed()):
            pass  # its first snapshot written: what the state takes
        taken = sum(f.stat().st_size for f in state.iterdir() if "snap" in f.name)
        reserve = _free(fs) - taken - args.room_kib * 1024
        cfg = write_config(work, tenants, 64, state={"dir": str(state), "reserve_bytes": reserve},
                           **sections)
        with daemon(source, cfg, work, preexec_fn=_placed()) as d, channel(d) as ch:
            stub = pb_grpc.BlockdServiceStub(ch)
            a, b = Session(stub, "sd-a"), Session(stub, "sd-b")
            refusal, served = None, 0
            for i in range(args.cycles):
                refusal = _cycle(a, i)
                if refusal is not None:
                    break
                served += 1
            other = _other_step(b, 0)
            time.sleep(args.recheck_s)
            other_later = _other_step(b, 1)
            m = metrics(d.endpoints["metrics"]) if d.endpoints.get("metrics") else {}
    return {"file_system": kind, "fs_kib": args.fs_kib, "room_kib": args.room_kib,
            "snapshot_bytes_at_start": taken, "reserve_bytes": reserve,
            "cycles_asked": args.cycles, "cycles_served": served, "refusal": refusal,
            "other_tenant_step": other, "other_tenant_step_later": other_later,
            "recheck_s": args.recheck_s,
            "snapshots_total": m.get("blockd_snapshots_total"),
            "state_dir_refusals_total": m.get("blockd_state_dir_refusals_total")}


# 4. /metrics with many live sequences ------------------------------------------------------

def attack_metrics(source: Path, side: str, args: argparse.Namespace) -> dict[str, Any]:
    ns = argparse.Namespace(sequences=args.sequences, blocks=4, scrapes=args.scrapes,
                            admits=args.admits, scrapers=4, scrape_seconds=args.scrape_seconds,
                            placement="isolated")
    return metrics_scrape.measure(side, source, ns, {})


ATTACKS: dict[str, Callable[[Path, str, argparse.Namespace], dict[str, Any]]] = {
    "fds": attack_fds, "oversized": attack_oversized, "state_dir": attack_state_dir,
    "metrics": attack_metrics}
