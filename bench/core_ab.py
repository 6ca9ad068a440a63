"""A/B of the core's cost between two commits, in instructions (callgrind), not seconds.

Seconds on this 2-core machine move with whatever else runs; instruction counts do not. For
each commit, ``core_replay.replay`` runs a small and a larger trace under
``valgrind --tool=callgrind``; the difference of the two totals is the replay's own cost
(interpreter start-up and imports cancel out). Block operations, steps and hit rates must be
identical between the two commits: a refactor that changes behaviour fails here first.

    python bench/core_ab.py 3e90cd5 HEAD     # prints a table, writes bench/results/core_ab.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"

#: Run inside the checked-out commit: replay the trace, print what it counted.
PROBE = """
import json, sys
root = sys.argv[1]
sys.path[:0] = [root + "/bench", root]
import core_replay as cr
import blockd.core.manager as m
assert m.__file__.startswith(root), m.__file__
from trace import make_trace
r = cr.replay(make_trace(int(sys.argv[2])), "blockd", 16, 20_000, 128)
print(json.dumps({k: r[k] for k in ("block_ops", "steps", "hit_rate_tokens")}))
"""


def instructions(tree: Path, requests: int, work: Path) -> tuple[int, dict[str, object]]:
    out = work / f"cg.{tree.name}.{requests}"
    proc = subprocess.run(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, "-c",
         PROBE, str(tree), str(requests)], capture_output=True, text=True, check=True, cwd=work)
    counted = json.loads(proc.stdout.strip().splitlines()[-1])
    total = next(int(line.split()[1]) for line in out.read_text().splitlines()
                 if line.startswith("summary:"))
    return total, counted


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base")
    ap.add_argument("head")
    ap.add_argument("--small", type=int, default=100)
    ap.add_argument("--large", type=int, default=400)
    ap.add_argument("--out", type=Path, default=RESULTS / "core_ab.json")
    args = ap.parse_args()
    result: dict[str, object] = {"requests": [args.small, args.large]}
    with tempfile.TemporaryDirectory(prefix="blockd-ab-") as tmp:
        work = Path(tmp)
        for label, rev in (("base", args.base), ("head", args.head)):
            tree = work / label
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q",
                            str(tree), rev], check=True)
            try:
                small, c_small = instructions(tree, args.small, work)
                large, c_large = instructions(tree, args.large, work)
            finally:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force",
                                str(tree)], check=True)
            result[label] = {"rev": rev, "instructions": [small, large],
                             "replay_instructions": large - small, "counted": [c_small, c_large]}
    base, head = result["base"], result["head"]
    assert isinstance(base, dict) and isinstance(head, dict)
    same = base["counted"] == head["counted"]
    ratio = head["replay_instructions"] / base["replay_instructions"]
    result["same_behaviour"] = same
    result["ratio_head_over_base"] = ratio
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    ops = head["counted"][1]["block_ops"] - head["counted"][0]["block_ops"]
    for label, r in (("base", base), ("head", head)):
        print(f"{label} {r['rev']}: {r['replay_instructions']:,} instructions for {ops:,} block "
              f"ops ({r['replay_instructions'] / ops:,.0f} per op)")
    print(f"head/base {ratio:.3f}; same block ops, steps and hit rates: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
