"""Issue 28's findings 1, 2, 4 and 7, each attack against the daemon before and after, one run.

"Before" is the audited commit (``--before``, 7bf01f8), checked out in a temporary git
worktree; "after" is this tree (or ``--after-commit``'s worktree). Each daemon runs its own
tree's code with this virtualenv (bench/source_daemon.py); the attacking clients are this
tree's. For every repetition (``--reps``) each attack runs against both daemons, one after the
other (the order alternates between repetitions, so a drift of the machine falls on both
sides), a fresh daemon each time, and the before/after ratio is taken per repetition:

1. ``fds``: the daemon under ``RLIMIT_NOFILE`` ``--nofile`` (soft and hard, set before it
   runs, as a container runtime does), two tenants with the default ``max_sessions`` (256):
   tenant A attaches sessions until refused, then tenant B does. Before: how many B got before
   its Attach failed, and how (INTERNAL, EMFILE). After: the audit's configuration is refused
   at start (its limits need more descriptors than there are), so the daemon runs with the
   largest ``server.max_sessions`` the descriptors allow; A is refused RESOURCE_EXHAUSTED at
   its share and B still attaches all of its share. Ratio: the share of its entitlement B got
   (after / before).
2. ``oversized``: three flooder tenants (separate processes) send ~``--step-mb`` MB Steps back
   to back for ``--flood-seconds``; another tenant's admit latency alone (before and after the
   flood) and under it, the bytes the daemon received from the flooders (their TCP
   connections' ``bytes_received``, read with ``ss``). Ratio: the victim's p99 inflation
   (under flood / alone) before over after.
3. ``state_dir``: ``state.dir`` on a ``--fs-kib`` tmpfs (a directory of /tmp where none can be
   mounted), ``state.reserve_bytes`` leaving ``--room-kib`` of journal room above the reserve;
   a tenant with a 10-block quota runs ``--cycles`` admit+release cycles of 10 blocks. Before:
   cycles served until "state dir full", and whether another tenant's Step is served then and
   ``--recheck-s`` later. After: the same. Ratio: cycles served after / before.
4. ``metrics``: bench/metrics_scrape.py's measurement (``--sequences`` live sequences, 4
   scrapers): the daemon's CPU per scrape (its event loop's time) and an admit's p50 beside the
   scrapers as a multiple of alone. Ratios: before / after of both.

Placement as in bench/metrics_scrape.py: the daemon on CPU 0, this client and its helper
processes on CPU 1 (the helpers at SCHED_IDLE). Writes bench/results/hardening_ab.json and
hardening_ab.png. Where the before commit is not in the clone (a shallow CI clone) only the
after side runs, and the JSON says so. No timed assertion: the figures are the result.

    python bench/hardening_ab.py            # 3 repetitions, every attack, both sides
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hardening_attacks import ATTACKS  # noqa: E402
from source_daemon import ROOT, git_tree, spread  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
BEFORE = "7bf01f8"
SIDES = ("before", "after")
#: Per attack: name -> (the row's figure, whether "after / before" (else before / after)).
RATIOS: dict[str, dict[str, tuple[str, bool]]] = {
    "fds": {"b_served_fraction_after_over_before": ("b_served_fraction", True)},
    "oversized": {"victim_p99_inflation_before_over_after": ("victim_p99_inflation", False),
                  "victim_p99_flooded_before_over_after": ("victim_p99_ms_flooded", False),
                  "bytes_received_per_call_before_over_after": ("bytes_received_per_call",
                                                                False),
                  "daemon_bytes_received_before_over_after": ("daemon_bytes_received",
                                                                 False)},
    "state_dir": {"cycles_served_after_over_before": ("cycles_served", True)},
    "metrics": {"admit_p50_ratio_before_over_after": ("admit_p50_ratio", False),
                "daemon_cpu_ms_per_scrape_before_over_after": ("daemon_cpu_ms_per_scrape",
                                                               False)}}
#: Per attack, the figures whose spread over repetitions is reported for each side.
FIGURES = {
    "fds": ("a_attached", "b_attached", "b_entitled", "b_served_fraction", "internal_refusals"),
    "oversized": ("victim_p50_ms_alone", "victim_p99_ms_alone", "victim_p99_ms_flooded",
                  "victim_p99_inflation", "victim_p50_inflation", "daemon_bytes_received",
                  "flood_calls", "bytes_received_per_call",
                  "daemon_cpu_share"),
    "state_dir": ("cycles_served",),
    "metrics": ("scrape_ms_p50", "daemon_cpu_ms_per_scrape", "admit_ms_p50_alone",
                "admit_ms_p50_scraped", "admit_p50_ratio")}
#: Per attack, the outcomes (strings) listed per side.
OUTCOMES = {"fds": ("audit_config_started", "a_refusal", "b_refusal", "a_step_after"),
            "state_dir": ("refusal", "other_tenant_step", "other_tenant_step_later"),
            "oversized": (), "metrics": ()}


def summarize(rows: list[dict[str, Any]], sides: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for attack in dict.fromkeys(r["attack"] for r in rows):
        mine = [r for r in rows if r["attack"] == attack]
        by = {(r["rep"], r["side"]): r for r in mine}
        reps = sorted({r["rep"] for r in mine})
        s: dict[str, Any] = {"sides": {}}
        for side in sides:
            got = [by[(i, side)] for i in reps if (i, side) in by]
            s["sides"][side] = {f: spread([r[f] for r in got]) for f in FIGURES[attack]}
            for f in OUTCOMES[attack]:
                s["sides"][side][f] = [r[f] for r in got]
        if set(sides) == set(SIDES):
            per_rep = []
            for i in reps:
                b, a = by[(i, "before")], by[(i, "after")]
                per_rep.append({name: (a[f] / max(b[f], 1e-9) if up else b[f] / max(a[f], 1e-9))
                                for name, (f, up) in RATIOS[attack].items()})
            s["per_rep"] = per_rep
            for name in RATIOS[attack]:
                s[name] = spread([p[name] for p in per_rep])
        out[attack] = s
    return out


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("fds", "b_served_fraction", "tenant B's sessions / its entitlement", False),
              ("oversized", "victim_p99_inflation", "victim admit p99, flooded / alone", True),
              ("state_dir", "cycles_served", "admit+release cycles served", False),
              ("metrics", "admit_p50_ratio", "admit p50, 4 scrapers / alone", True)]
    fig, axes = plt.subplots(2, 2, figsize=(9, 6.5))
    for ax, (attack, figure, label, log) in zip(axes.flat, panels, strict=True):
        for k, side in enumerate(SIDES):
            got = sorted((r["rep"], r[figure]) for r in rows
                         if r["attack"] == attack and r["side"] == side)
            if got:
                ax.bar([i + (k - 0.5) * 0.4 for i, _ in got], [y for _, y in got], width=0.4,
                       label=side, color=("tab:red", "tab:blue")[k])
        ax.set_title(f"{attack}: {label}", fontsize=9)
        ax.set_xlabel("repetition")
        if log:
            ax.set_yscale("log")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle("issue 28 findings 1, 2, 4, 7: before (7bf01f8) and after, one run",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _commit(tree: Path) -> str:
    """The commit ``tree`` has checked out, "+ changes" where its files differ from it."""
    head = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=False).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(tree), "diff", "--quiet", "HEAD", "--", "blockd",
                            "apps"], check=False).returncode
    return head + (" + changes in blockd/ or apps/" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--attacks", default=",".join(ATTACKS))
    ap.add_argument("--sides", default=",".join(SIDES))
    ap.add_argument("--before", default=BEFORE, help="the audited commit")
    ap.add_argument("--after-commit", default="",
                    help="a commit for the after side (default: this tree as it is)")
    ap.add_argument("--nofile", type=int, default=1024)
    ap.add_argument("--flooders", type=int, default=3)
    ap.add_argument("--step-mb", type=float, default=12.0)
    ap.add_argument("--flood-seconds", type=float, default=8.0)
    ap.add_argument("--flood-sched", choices=("idle", "normal"), default="idle",
                    help="the oversized flooders at SCHED_IDLE on CPU 1 (default: they run "
                         "when the victim's client waits) or at normal priority there")
    ap.add_argument("--admits", type=int, default=300)
    ap.add_argument("--fs-kib", type=int, default=4096)
    ap.add_argument("--room-kib", type=int, default=160)
    ap.add_argument("--cycles", type=int, default=1500)
    ap.add_argument("--recheck-s", type=float, default=2.0)
    ap.add_argument("--sequences", type=int, default=131_072)
    ap.add_argument("--scrapes", type=int, default=100)
    ap.add_argument("--scrape-seconds", type=float, default=5.0)
    ap.add_argument("--out", type=Path, default=RESULTS / "hardening_ab.json")
    args = ap.parse_args(argv)
    attacks, sides = args.attacks.split(","), args.sides.split(",")
    os.sched_setaffinity(0, {1})  # this client and its helpers off the daemon's CPU 0
    notes: list[str] = []
    with contextlib.ExitStack() as stack:
        trees: dict[str, Path] = {}
        if "before" in sides:
            old = stack.enter_context(git_tree(args.before))
            if old is None:
                notes.append(f"before side skipped: commit {args.before} is not in this clone "
                             "(a shallow clone?)")
                sides.remove("before")
            else:
                trees["before"] = old
        if "after" in sides:
            new = stack.enter_context(git_tree(args.after_commit)) if args.after_commit \
                else ROOT
            if new is None:
                raise SystemExit(f"--after-commit {args.after_commit} is not in this clone")
            trees["after"] = new
        commits = {side: _commit(tree) for side, tree in trees.items()}
        rows: list[dict[str, Any]] = []
        for rep in range(args.reps):
            for attack in attacks:
                for side in (sides if rep % 2 == 0 else sides[::-1]):
                    t0 = time.monotonic()
                    row = ATTACKS[attack](trees[side], side, args)
                    row.update(rep=rep, attack=attack, side=side,
                               seconds=time.monotonic() - t0, loadavg_1m=os.getloadavg()[0])
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    summary = summarize(rows, sides)
    out = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
           "sides_run": sides, "commits": commits, "notes": notes,
           "python": platform.python_version(),
           "cpus": os.cpu_count(), "rows": rows, "summary": summary,
           "command": "python bench/hardening_ab.py " + " ".join(sys.argv[1:])}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    plot(rows, args.out.with_suffix(".png"))
    print(json.dumps({a: {k: v for k, v in s.items() if k != "sides"}
                      for a, s in summary.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
