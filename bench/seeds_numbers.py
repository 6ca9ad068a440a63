"""The seed documents' numbers, reproduced on synthetic traces through blockd's core.

The seeds (../shared/seeds/) claim:

1. a contiguous allocator that reserves each request's maximum length wastes 60-80% of KV
   memory, while paged allocation wastes only the unused tail of each sequence's last block:
   "under 4%" at block size 16;
2. prefix sharing cuts KV memory by 30-55% on workloads with long shared prefixes;
3. tail waste grows with the block size (8 / 16 / 32).

This replays two traces (``bench/trace.py``'s ``make_trace``) through the pure-Python
``BlockManager`` in process, with continuous batching (at most ``--max-running`` sequences,
admitted in arrival order, one token per sequence per step, a follow-up turn only after the
turn it continues), and integrates memory over scheduler steps:

- ``system``: the foundation trace (6 shared system prompts of 870-1270 tokens, 90-540-token
  user turns, a third multi-turn follow-ups, ~137 output tokens; ~1,600 tokens at completion);
- ``chat``: short independent chats (no system prompt, 20-400-token prompts, ~137 output
  tokens; ~350 tokens at completion), the regime of most public chat traces.

Per step, over the running sequences (each holding ``tokens`` K/V slots):

- contiguous waste  = 1 - sum(tokens) / (sequences x max_len): each request reserves the model's
  maximum length at admission (``--max-len``; the figure depends on this assumption);
- paged tail waste  = 1 - sum(tokens) / (sum(ceil(tokens / B)) x B): only last blocks have
  unused slots (counted per sequence, as an allocator without sharing holds them);
- sharing saving    = 1 - distinct referenced blocks / sum of the sequences' block counts: what
  prefix hits (the same physical block in several tables) save over private copies. Cached but
  unreferenced blocks are reclaimable and not counted.

Each ratio is a ratio of sums over all steps (time-weighted memory), printed, and written to
``bench/results/seeds_numbers.json`` with a plot in ``seeds_numbers.png``. docs/seeds.md
explains the model behind each figure.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from array import array
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trace import Arrivals, Request, make_trace  # noqa: E402

from blockd.core import BlockManager, PoolSpec, PrefixScope, TenantPolicy  # noqa: E402
from blockd.core.blocks import COMMITTED, WRITING  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SCOPE = PrefixScope("seed-model", model_revision="r1", tokenizer_digest=b"tok")
BLOCK_SIZES = (8, 16, 32)
MAX_LENS = (2048, 4096)
TRACES = {
    "system": {},
    "chat": {"system_len": (0, 0), "user_len": (20, 400), "followup_share": 0.0},
}
#: The sharing saving depends on how much of each sequence is the shared prefix: the
#: ``system`` trace again with shorter system prompts (same user turns and outputs).
SHARING_SWEEP = {"220-320": (220, 320), "435-635": (435, 635), "870-1270": (870, 1270)}


@dataclass
class Usage:
    """Memory integrated over scheduler steps (sums of per-step values)."""

    block_size: int
    steps: int = 0
    seq_steps: int = 0
    token_steps: int = 0
    table_block_steps: int = 0
    distinct_block_steps: int = 0
    peak_table_blocks: int = 0
    peak_distinct_blocks: int = 0
    longest: int = 0
    hit_tokens: int = 0
    queried_tokens: int = 0
    #: (step, sequences, tokens, table blocks, distinct blocks), every ``sample_every`` steps.
    series: list[tuple[int, int, int, int, int]] = field(default_factory=list)

    def paged_tail_waste(self) -> float:
        return 1 - self.token_steps / (self.table_block_steps * self.block_size)

    def contiguous_waste(self, max_len: int) -> float:
        return 1 - self.token_steps / (self.seq_steps * max_len)

    def sharing_saving(self) -> float:
        return 1 - self.distinct_block_steps / self.table_block_steps

    def mean_tokens(self) -> float:
        return self.token_steps / self.seq_steps


def replay(trace: list[Request], block_size: int, *, cache: bool = True, max_running: int = 64,
           sample_every: int = 8) -> Usage:
    """Continuous batching of ``trace`` through a BlockManager big enough to never refuse."""
    longest = max(len(r.prompt) + len(r.output) for r in trace)
    num_blocks = max_running * math.ceil(longest / block_size) + 64
    m = BlockManager(PoolSpec(block_size=block_size, num_blocks=num_blocks),
                     [TenantPolicy("bench", quota_blocks=num_blocks)], seed=7)
    session = m.open_session("bench")
    usage = Usage(block_size, longest=longest)
    arrivals = Arrivals(trace)
    # seq id -> [request index, tokens held, admission step]
    running: dict[str, list[int]] = {}
    step = 0
    state = m.blocks.state

    def admit(i: int) -> bool:
        res = m.admit(session, SCOPE, array("I", trace[i].prompt).tobytes(), cache=cache)
        assert hasattr(res, "seq_id"), f"the pool was sized never to refuse: {res}"
        m.commit(session, res.seq_id, step)  # prompt K/V written by this step's kernels
        running[res.seq_id] = [i, len(trace[i].prompt), step]
        return True

    while arrivals.pending() or running:
        step += 1
        # Each step announces its fence; the previous step's kernels are done.
        m.begin_step(session, step, step - 1)
        arrivals.arrive(step)
        arrivals.admit(max_running - len(running), admit)
        # Decode: the token sampled last step gets its slot (output k is sampled from the
        # logits of the step that wrote token k - 1; the last one never needs a slot).
        for seq_id, st in running.items():
            i, n, admitted = st
            k = n - len(trace[i].prompt)
            if admitted < step and k < len(trace[i].output) - 1:
                m.append(session, seq_id, [trace[i].output[k]], step)
                st[1] = n + 1
                if st[1] % block_size == 0:
                    m.commit(session, seq_id, step)
        # What the step's kernels hold: every running sequence's slots.
        tokens = sum(st[1] for st in running.values())
        table_blocks = sum(-(-st[1] // block_size) for st in running.values())
        distinct = state.count(WRITING) + state.count(COMMITTED)
        usage.steps += 1
        usage.seq_steps += len(running)
        usage.token_steps += tokens
        usage.table_block_steps += table_blocks
        usage.distinct_block_steps += distinct
        usage.peak_table_blocks = max(usage.peak_table_blocks, table_blocks)
        usage.peak_distinct_blocks = max(usage.peak_distinct_blocks, distinct)
        if step % sample_every == 0:
            usage.series.append((step, len(running), tokens, table_blocks, distinct))
        # Sequences whose last token was generated this step end (under this step's fence).
        for seq_id in [s for s, (i, n, _) in running.items()
                       if n - len(trace[i].prompt) >= len(trace[i].output) - 1]:
            i = running.pop(seq_id)[0]
            m.release(session, seq_id, step)
            arrivals.finished[i] = True
    usage.hit_tokens = m.counters.hit_tokens
    usage.queried_tokens = m.counters.queried_tokens
    return usage


def measure(num_requests: int, max_running: int, seed: int) -> dict[str, object]:
    out: dict[str, object] = {"num_requests": num_requests, "max_running": max_running,
                              "seed": seed, "traces": {}}
    for name, kw in TRACES.items():
        trace = make_trace(num_requests, seed=seed, **kw)
        lengths = [len(r.prompt) + len(r.output) for r in trace]
        t = {"mean_final_tokens": sum(lengths) / len(lengths), "longest": max(lengths),
             "requests_over": {L: sum(n > L for n in lengths) for L in MAX_LENS},
             "by_block_size": {}}
        for B in BLOCK_SIZES:
            u = replay(trace, B, cache=(name == "system"), max_running=max_running)
            t["by_block_size"][B] = {
                "mean_live_tokens": u.mean_tokens(),
                "paged_tail_waste": u.paged_tail_waste(),
                # Model: a last block is uniformly 1..B full, so (B - 1) / 2 empty slots.
                "tail_waste_model": ((B - 1) / 2) / (u.mean_tokens() + (B - 1) / 2),
                "contiguous_waste": {L: u.contiguous_waste(L) for L in MAX_LENS},
                "sharing_saving": u.sharing_saving(),
                "peak_blocks_without_sharing": u.peak_table_blocks,
                "peak_blocks_with_sharing": u.peak_distinct_blocks,
                "prefix_hit_rate": u.hit_tokens / max(1, u.queried_tokens),
                "steps": u.steps,
            }
            if B == 16:
                t["series_b16"] = u.series
        out["traces"][name] = t
    sweep = {}
    for label, system_len in SHARING_SWEEP.items():
        trace = make_trace(num_requests, seed=seed, system_len=system_len)
        u = replay(trace, 16, cache=True, max_running=max_running)
        sweep[label] = {"sharing_saving": u.sharing_saving(),
                        "mean_live_tokens": u.mean_tokens(),
                        "prefix_hit_rate": u.hit_tokens / max(1, u.queried_tokens)}
    out["sharing_by_system_len"] = sweep
    # Cross-check the sharing figure with a real no-sharing run: its blocks are the sum of the
    # sequences' block counts of the sharing run, step for step (same admissions, no refusals).
    trace = make_trace(num_requests, seed=seed)
    on = replay(trace, 16, cache=True, max_running=max_running)
    off = replay(trace, 16, cache=False, max_running=max_running)
    assert off.distinct_block_steps == off.table_block_steps == on.table_block_steps
    out["no_sharing_run_matches"] = True
    return out


def render(res: dict[str, object]) -> str:
    tr = res["traces"]
    sys_, chat = tr["system"], tr["chat"]
    lines = [f"seeds' numbers: {res['num_requests']} requests per trace, at most "
             f"{res['max_running']} running, time-weighted over scheduler steps"]
    for name, t in (("chat", chat), ("system", sys_)):
        b16 = t["by_block_size"][16]
        lines.append(
            f"[{name}] mean {b16['mean_live_tokens']:.0f} tokens held per running sequence "
            f"({t['mean_final_tokens']:.0f} at completion, longest {t['longest']})")
        for L in MAX_LENS:
            over = t["requests_over"][L]
            lines.append(f"  contiguous reservation of max length {L}: "
                         f"{b16['contiguous_waste'][L]:6.1%} waste"
                         + (f"  ({over} requests longer than that)" if over else ""))
        lines.append(f"  paged, block size 16:                     "
                     f"{b16['paged_tail_waste']:6.1%} waste (tail of last blocks)")
        lines.append("  tail waste by block size: " + ", ".join(
            f"B={B} {t['by_block_size'][B]['paged_tail_waste']:.2%} "
            f"(model {t['by_block_size'][B]['tail_waste_model']:.2%})" for B in BLOCK_SIZES))
    b16 = sys_["by_block_size"][16]
    lines.append(f"[system] prefix sharing saves {b16['sharing_saving']:.1%} of KV blocks "
                 f"(time-weighted; peak {b16['peak_blocks_with_sharing']:,} vs "
                 f"{b16['peak_blocks_without_sharing']:,} blocks without sharing); prefix "
                 f"hit rate {b16['prefix_hit_rate']:.1%} of prompt tokens")
    lines.append("  by system-prompt length: " + ", ".join(
        f"{label} tokens {v['sharing_saving']:.1%} saved (hit rate "
        f"{v['prefix_hit_rate']:.0%}, {v['mean_live_tokens']:.0f} tokens held)"
        for label, v in res["sharing_by_system_len"].items()))
    return "\n".join(lines)


def plot(res: dict[str, object], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tr = res["traces"]
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    ax = axes.ravel()
    a = ax[0]
    labels, values, colors = [], [], []
    for name in ("chat", "system"):
        b16 = tr[name]["by_block_size"][16]
        for L in MAX_LENS:
            labels.append(f"{name}\ncontig. {L}")
            values.append(100 * b16["contiguous_waste"][L])
            colors.append("tab:red")
        labels.append(f"{name}\npaged B=16")
        values.append(100 * b16["paged_tail_waste"])
        colors.append("tab:blue")
    bars = a.bar(range(len(values)), values, color=colors)
    a.bar_label(bars, fmt="%.1f%%", fontsize=8)
    a.set_xticks(range(len(values)), labels, fontsize=8)
    a.axhspan(60, 80, color="tab:red", alpha=0.08, label="seeds: 60-80%")
    a.axhline(4, color="tab:blue", ls=":", lw=1, label="seeds: under 4%")
    a.set_ylabel("% of reserved KV slots unused")
    a.set_title("contiguous max-length reservation vs paged")
    a.legend(fontsize=8)
    a = ax[1]
    series = tr["system"]["series_b16"]
    steps = [s[0] for s in series]
    a.plot(steps, [s[3] for s in series], label="without sharing (blocks in the tables)")
    a.plot(steps, [s[4] for s in series], label="with prefix sharing (distinct blocks)")
    b16 = tr["system"]["by_block_size"][16]
    a.set_title(f"shared system prompts: sharing saves {b16['sharing_saving']:.0%} "
                f"(seeds: 30-55%)")
    a.set_xlabel("scheduler step")
    a.set_ylabel("KV blocks held (B=16)")
    a.legend(fontsize=8)
    a = ax[2]
    for name, color in (("chat", "tab:orange"), ("system", "tab:green")):
        bb = tr[name]["by_block_size"]
        a.plot(BLOCK_SIZES, [100 * bb[B]["paged_tail_waste"] for B in BLOCK_SIZES], "o-",
               color=color, label=f"{name} (measured)")
        a.plot(BLOCK_SIZES, [100 * bb[B]["tail_waste_model"] for B in BLOCK_SIZES], "--",
               color=color, alpha=0.6, label=f"{name} (model (B-1)/2 per sequence)")
    a.axhline(4, color="tab:blue", ls=":", lw=1, label="seeds: under 4%")
    a.set_xticks(BLOCK_SIZES)
    a.set_xlabel("block size (tokens)")
    a.set_ylabel("paged tail waste (%)")
    a.set_title("tail waste vs block size")
    a.legend(fontsize=8)
    a = ax[3]
    sweep = res["sharing_by_system_len"]
    bars = a.bar(range(len(sweep)), [100 * v["sharing_saving"] for v in sweep.values()],
                 color="tab:purple")
    a.bar_label(bars, fmt="%.1f%%", fontsize=8)
    a.set_xticks(range(len(sweep)), [f"system prompts\n{k} tokens" for k in sweep], fontsize=8)
    a.axhspan(30, 55, color="tab:purple", alpha=0.1, label="seeds: 30-55%")
    a.set_ylabel("% of KV blocks saved by sharing")
    a.set_title("sharing saving vs shared-prefix length (B=16)")
    a.legend(fontsize=8)
    fig.suptitle(f"{res['num_requests']} requests per trace, at most {res['max_running']} "
                 f"running; time-weighted over scheduler steps", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS / "seeds_numbers.json")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    res = measure(args.requests, args.max_running, args.seed)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    res["command"] = "python bench/seeds_numbers.py " + " ".join(argv or sys.argv[1:])
    print(render(res))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1, default=_jsonable) + "\n")
    plot(res, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')} in {res['seconds']} s")
    return 0


def _jsonable(o: object) -> object:
    if hasattr(o, "__dataclass_fields__"):
        return asdict(o)  # type: ignore[arg-type]
    raise TypeError(type(o).__name__)


if __name__ == "__main__":
    sys.exit(main())
