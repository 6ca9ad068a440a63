"""What plans that are done owe blockd: their commits and releases.

The scheduler side looks at a plan again only when something about it changed (``dirty``: its
first step, a load or save handed out, a save report, its request ended, an append answered).
``resolution_ops`` then commits and/or releases each dirty plan that is done
(``Plan.decide``) and forgets it, and releases the sequences no plan owns any more
(``to_release``: an answer nobody took, a plan dropped). A plan blockd lost under it
(``abandoned``) is only released, once vLLM cannot still be waiting for its loads. A request
that ended with a save still to run or to be reported owes its commit (``finishing``): an idle
engine sends a new request's admit only behind it, so the next turn of a conversation hits the
previous one.
"""

from __future__ import annotations

from collections import Counter

from blockd.api.v1 import blockd_pb2 as pb
from blockd_client import requests as rq
from blockd_vllm.plan import Plan


def finishing(plans: dict[str, Plan]) -> bool:
    """A request ended with a save still to run or to be reported (its Commit to come)."""
    return any(p.finished and (p.held or p.pending) and not (p.abandoned or p.failed)
               for p in plans.values())


def resolution_ops(plans: dict[str, Plan], dirty: set[str], to_release: list[str], epoch: int,
                   B: int, counters: Counter[str]) -> tuple[list[pb.Operation], list[str]]:
    """Commits and releases of every dirty plan that is done (forgotten: removed from
    ``plans``), and the pending releases; ``dirty`` and ``to_release`` are emptied. Returns the
    operations and the sequences they release."""
    ops: list[pb.Operation] = []
    releases: list[str] = []
    for rid in dirty:
        plan = plans.get(rid)
        if plan is not None and resolve(plan, ops, epoch, B, counters):
            if plan.epoch == epoch:
                releases.append(plan.seq_id)
            del plans[rid]
    dirty.clear()
    releases += to_release
    ops += [rq.release(seq_id) for seq_id in to_release]
    to_release.clear()
    return ops, releases


def resolve(plan: Plan, ops: list[pb.Operation], epoch: int, B: int,
            counters: Counter[str]) -> bool:
    """Commit and/or release ``plan`` (appended to ``ops``) when it is done; True when it is."""
    if plan.abandoned:
        if plan.held or not (plan.scheduled or plan.finished):
            return False  # vLLM may have been promised its blocks: load them first
        if plan.epoch == epoch:
            ops.append(rq.release(plan.seq_id))
        return True
    commit, done = plan.decide(B)
    if commit:
        ops.append(rq.commit(plan.seq_id))
        counters["committed_blocks"] += plan.saved - plan.committed
        plan.committed = plan.saved
    if done:
        ops.append(rq.release(plan.seq_id))
    return done
