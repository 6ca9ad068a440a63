"""How long B's calls of bench/fairness.py hold the daemon's loop, measured in-process.

Builds the daemon of ``bench/fairness.py`` (its config, no budget) in this process, no gRPC,
and times, as medians over ``--reps`` repetitions, the stretches one of B's calls takes:
parsing its huge Step (eight admits summing to just under ``server.max_work_per_call``),
copying one admit's token ids out of protobuf's repeated field both ways (through a list, as
``step.token_bytes`` did before, and through numpy, as it does now: same field, same run),
applying the Step (``Daemon.step``) and its release, and serving its 256k-token Lookup
(cutting, counting and checking the ids, then ``Daemon.lookup``). Writes
bench/results/loop_stretches.json. No timed assertion: the figures are the result.

    python bench/loop_stretches.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fairness  # noqa: E402

from blockd import config  # noqa: E402
from blockd.api.v1 import blockd_pb2 as pb  # noqa: E402
from blockd.runtime import packed  # noqa: E402
from blockd.runtime import startup as runtime  # noqa: E402
from blockd.server.servicer import LOOKUP_TOKEN_IDS  # noqa: E402


def median_ms(fn: Callable[[], Any], reps: int) -> float:
    fn()  # warm
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return round(statistics.median(times), 3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--max-work", type=int, default=1 << 17)
    ap.add_argument("--out", type=Path, default=fairness.RESULTS / "loop_stretches.json")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="blockd-stretch-") as tmp:
        fairness.RATE = 0  # no budget: every call is served
        cfg = config.load(argparse.Namespace(
            config=str(fairness.config(Path(tmp), args.max_work))), {})
        d = runtime.start(cfg)
        p = d.sessions.authenticate(fairness.md("b"))
        att = d.attach(p, pb.AttachRequest(worker_name="b", tenant_id="b",
                                           layout=fairness.LAYOUT))
        lookup_raw, ops = fairness.requests(att.session_id, att.epoch, args.max_work)
        step_id = [0]

        def step_raw() -> bytes:
            step_id[0] += 1
            return fairness.step_bytes(att.session_id, att.epoch, step_id[0], ops)

        raw = step_raw()
        field = pb.StepRequest.FromString(raw).operations[0].admit.token_ids

        def apply_and_release() -> tuple[float, float]:
            req = pb.StepRequest.FromString(step_raw())
            t0 = time.perf_counter()
            resp = d.step(p, req)
            t1 = time.perf_counter()
            step_id[0] += 1
            rel = pb.StepRequest(session_id=att.session_id, epoch=att.epoch,
                                 step_id=step_id[0], operations=[
                                     pb.Operation(release=pb.ReleaseOp(sequence_id=r.admit
                                                                       .sequence_id))
                                     for r in resp.results if r.status.code == 0])
            t2 = time.perf_counter()
            d.step(p, rel)
            return (t1 - t0) * 1000, (time.perf_counter() - t2) * 1000

        applied = [apply_and_release() for _ in range(args.reps + 1)][1:]

        def lookup() -> None:
            rest, payloads = packed.split_field(lookup_raw, LOOKUP_TOKEN_IDS)
            ids = packed.PackedIds(payloads)
            d.lookup(p, pb.LookupRequest.FromString(rest), ids)

        res = {
            "step_bytes": len(raw), "ids_per_admit": len(field),
            "parse_step_ms": median_ms(lambda: pb.StepRequest.FromString(raw), args.reps),
            "copy_ids_list_ms": median_ms(lambda: array("I", field[:]).tobytes(), args.reps),
            "copy_ids_numpy_ms": median_ms(
                lambda: np.asarray(field, dtype="<u4").tobytes(), args.reps),
            "apply_step_ms": round(statistics.median(a for a, _ in applied), 3),
            "release_step_ms": round(statistics.median(r for _, r in applied), 3),
            "lookup_bytes": len(lookup_raw),
            "lookup_ms": median_ms(lookup, args.reps),
            "reps": args.reps,
        }
        d.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
