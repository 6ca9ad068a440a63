"""``blockd demo``: a real transformer served through an embedded daemon, measured.

It starts a daemon (``blockd serve`` through ``launch``, a temporary config, its Unix sockets in a
temporary directory, no TCP, no metrics port), attaches the reference worker
(``blockd_apps.reference``: a tiny Llama-style decoder with seeded random weights), runs a
workload of requests sharing a few system prompts with continuous batching, and then:

- prints a summary: requests, tokens, prefix hit rate, blocks saved by sharing, KV memory waste
  of paged allocation versus a contiguous max-length reservation, peak blocks, preemptions, and
  (unless ``--no-check``) how far the served logits are from a contiguous no-cache forward pass;
- writes a PNG (``--out``) with four panels over scheduler steps: prefix hit rate, blocks saved
  by sharing, KV waste (paged vs contiguous), free blocks; and the numbers as JSON beside it.

Accounting, per step, over the sequences holding blocks (the model behind each panel):

- tokens: slots assigned to tokens (a prompt being prefilled counts whole: its blocks are);
- paged waste: 1 - tokens / (blocks in the tables x block_size), the unused tail of each
  sequence's last block (shared blocks counted once per table: the no-sharing allocator);
- contiguous waste: 1 - tokens / (sequences x ``--max-len``), what reserving the model's
  maximum length per request up front leaves unused (depends on that assumed maximum);
- blocks saved by sharing: blocks named in the tables minus distinct blocks (prefix hits and
  forks point several tables at one block);
- free blocks: the daemon's FREE blocks, and FREE + CACHED (reusable on demand).

Defaults finish in about a minute on 2 CPU cores; ``--requests`` and friends scale it.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from blockd import options
from blockd_apps.launch import spawn

#: Relative to the directory it runs in, never into a checkout's tracked bench/results (the
#: committed plot there is ``--out bench/results/demo.png``'s, written on purpose).
DEFAULT_OUT = Path("blockd-demo") / "demo.png"


# -- the embedded daemon ----------------------------------------------------------------------


@contextmanager
def embedded_daemon(pool: dict[str, Any], *, ready_timeout: float = 60.0) -> Iterator[str]:
    """Run ``blockd serve`` on a temporary config; yields its ``unix:`` target.

    No tenants file: the daemon's single ``default`` tenant, acting for anonymous callers (the
    laptop default), quota = the whole pool.
    """
    with tempfile.TemporaryDirectory(prefix="blockd-demo-") as tmp:
        cfg = {
            "server": {"unix_socket": f"{tmp}/blockd.sock", "tcp_address": "",
                       "handle_socket": f"{tmp}/pool.sock", "grace_seconds": 2.0},
            "metrics": {"address": ""},
            "pool": pool,
            "log": {"level": "WARNING"},
        }
        cfg_path = Path(tmp) / "blockd.yaml"
        cfg_path.write_text(yaml.safe_dump(cfg))
        launched = spawn(cfg_path, Path(tmp), ready_timeout=ready_timeout)
        try:
            yield f"unix:{launched.endpoints['unix']}"
        finally:
            launched.stop(15)


# -- the workload -----------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkloadShape:
    requests: int = 160
    system_prompts: int = 4
    system_len: tuple[int, int] = (96, 192)
    user_len: tuple[int, int] = (8, 64)
    new_tokens: tuple[int, int] = (16, 48)
    #: Share of requests asking for 2 samples (parallel sampling: fork + copy-on-write).
    two_samples: float = 0.15
    #: Mean requests arriving per scheduler step.
    arrivals_per_step: float = 0.5
    seed: int = 0


def make_workload(shape: WorkloadShape, vocab: int) -> list[Any]:
    """Requests on a few shared system prompts (Zipf-like popularity) + unique user turns."""
    from blockd_apps.reference import Request

    rng = random.Random(shape.seed)
    systems = [[rng.randrange(vocab) for _ in range(rng.randint(*shape.system_len))]
               for _ in range(shape.system_prompts)]
    weights = [1 / (i + 1) for i in range(shape.system_prompts)]
    t = 0.0
    out = []
    for i in range(shape.requests):
        t += rng.expovariate(shape.arrivals_per_step)
        system = rng.choices(systems, weights)[0]
        user = [rng.randrange(vocab) for _ in range(rng.randint(*shape.user_len))]
        out.append(Request(system + user, max_new_tokens=rng.randint(*shape.new_tokens),
                           n=2 if rng.random() < shape.two_samples else 1,
                           request_id=f"req{i}", arrival=1 + int(t)))
    return out


# -- per-step accounting ----------------------------------------------------------------------


@dataclass
class StepRecord:
    step: int
    sequences: int
    tokens: int
    table_blocks: int
    distinct_blocks: int
    free_blocks: int
    cached_blocks: int
    hit_rate: float
    max_len: int
    block_size: int

    @property
    def paged_waste(self) -> float:
        slots = self.table_blocks * self.block_size
        return 1 - self.tokens / slots if slots else 0.0

    @property
    def contiguous_waste(self) -> float:
        slots = self.sequences * self.max_len
        return 1 - self.tokens / slots if slots else 0.0

    @property
    def saved_blocks(self) -> int:
        return self.table_blocks - self.distinct_blocks


@dataclass
class Timeline:
    client: Any
    max_len: int
    records: list[StepRecord] = field(default_factory=list)

    def __call__(self, engine: Any) -> None:
        tables = engine.session.tables
        seqs = list(engine.live.items())
        blocks = [tables.blocks(seq_id) for seq_id, _ in seqs]
        stats = self.client.stats()
        self.records.append(StepRecord(
            step=engine.step_no, sequences=len(seqs),
            tokens=sum(s.daemon_tokens for _, s in seqs),
            table_blocks=sum(len(b) for b in blocks),
            distinct_blocks=len(set().union(*blocks)) if blocks else 0,
            free_blocks=stats.blocks_free, cached_blocks=stats.blocks_cached,
            hit_rate=engine.stats.hit_rate, max_len=self.max_len,
            block_size=engine.block_size))

    def weighted(self, attr: str, weight: str) -> float:
        """Mean of a per-step ratio, weighted by the step's slots (the memory it describes)."""
        num = den = 0.0
        for r in self.records:
            w = (r.table_blocks * r.block_size if weight == "paged" else
                 r.sequences * r.max_len)
            num += getattr(r, attr) * w
            den += w
        return num / den if den else 0.0


# -- progress, plot, summary ------------------------------------------------------------------


class ProgressBar:
    """A carriage-return bar on stderr (no dependency), redrawn at most 10 times a second."""

    def __init__(self, total: int, width: int = 30, enabled: bool = True) -> None:
        self.total, self.width, self.enabled = total, width, enabled
        self.last = 0.0

    def __call__(self, engine: Any, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (now - self.last < 0.1 and not force):
            return
        self.last = now
        done = sum(r.finished for r in engine.requests)
        fill = int(self.width * done / max(1, self.total))
        sys.stderr.write(f"\r[{'#' * fill}{'.' * (self.width - fill)}] {done}/{self.total} "
                         f"requests | step {engine.step_no} | running {len(engine.live)} | "
                         f"prefix hits {engine.stats.hit_rate:5.1%}")
        sys.stderr.flush()

    def close(self, engine: Any) -> None:
        if self.enabled:
            self(engine, force=True)
            sys.stderr.write("\n")


def plot(timeline: Timeline, num_blocks: int, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = timeline.records
    steps = [r.step for r in recs]
    fig, ax = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    a = ax[0][0]
    a.plot(steps, [100 * r.hit_rate for r in recs], color="tab:green")
    a.set_title("prefix hit rate (cumulative, % of prompt tokens)")
    a.set_ylim(0, 100)
    a = ax[0][1]
    a.plot(steps, [r.table_blocks for r in recs], label="blocks named in block tables")
    a.plot(steps, [r.distinct_blocks for r in recs], label="distinct blocks (shared once)")
    a.fill_between(steps, [r.distinct_blocks for r in recs], [r.table_blocks for r in recs],
                   alpha=0.25, label="saved by sharing")
    a.set_title("blocks saved by sharing")
    a.legend(fontsize=8)
    a = ax[1][0]
    busy = [r for r in recs if r.sequences]  # no sequence, no memory: no ratio
    a.plot([r.step for r in busy], [100 * r.contiguous_waste for r in busy], color="tab:red",
           label=f"contiguous reservation of {timeline.max_len} tokens/request")
    a.plot([r.step for r in busy], [100 * r.paged_waste for r in busy], color="tab:blue",
           label=f"paged, block size {recs[0].block_size if recs else '?'} (tail waste)")
    a.set_title("KV memory waste (% of reserved slots unused)")
    a.set_ylim(0, 100)
    a.set_xlabel("scheduler step")
    a.legend(fontsize=8)
    a = ax[1][1]
    a.plot(steps, [r.free_blocks for r in recs], label="FREE")
    a.plot(steps, [r.free_blocks + r.cached_blocks for r in recs],
           label="FREE + CACHED (reusable)")
    a.axhline(num_blocks, color="gray", lw=0.8, ls="--", label="pool")
    a.set_title("free blocks")
    a.set_xlabel("scheduler step")
    a.set_ylim(0, num_blocks * 1.15)
    a.legend(fontsize=8, loc="upper center", ncol=3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def check_logits(model: Any, states: list[Any]) -> tuple[int, float]:
    """Every generated position vs a contiguous no-cache forward: (positions, max |diff|)."""
    import torch

    worst, n = 0.0, 0
    for st in states:
        for s in st.samples:
            ref = model(s.tokens[:-1])[len(s.request.prompt) - 1:].float().cpu()
            got = torch.stack(s.logits)
            worst = max(worst, float((got - ref).abs().max()))
            n += got.shape[0]
    return n, worst


# -- main -------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = options.Parser(prog="blockd demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=WorkloadShape.requests)
    p.add_argument("--system-prompts", type=int, default=WorkloadShape.system_prompts)
    p.add_argument("--new-tokens", type=int, nargs=2, default=WorkloadShape.new_tokens,
                   metavar=("MIN", "MAX"))
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=144, help="pool size in blocks")
    p.add_argument("--max-len", type=int, default=1024,
                   help="max model length a contiguous allocator reserves per request")
    p.add_argument("--max-running", type=int, default=32)
    p.add_argument("--prefill-chunk", type=int, default=128,
                   help="prompt tokens computed per step")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (Triton kernels, CUDA pool)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help="PNG to write, its data beside it as .json (default: %(default)s)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-check", action="store_true",
                   help="skip comparing the served logits with a contiguous forward pass")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        import torch
    except ImportError:
        print("blockd demo needs torch (pip install 'blockd[gpu]')", file=sys.stderr)
        return 2
    from blockd_apps.reference import Engine, EngineConfig, ModelConfig, TinyLlama
    from blockd_client import Client

    if args.device == "cpu":
        # The tiny model's matmuls are too small to split across threads, and the daemon
        # needs a core: one intra-op thread is several times faster on a small machine.
        torch.set_num_threads(1)
    cfg = ModelConfig(vocab_size=512, d_model=128, num_layers=4, num_heads=4, num_kv_heads=2,
                      head_dim=32, ffn_dim=256, seed=args.seed)
    model = TinyLlama(cfg, device=args.device)
    shape = WorkloadShape(requests=args.requests, system_prompts=args.system_prompts,
                          new_tokens=tuple(args.new_tokens), seed=args.seed)
    requests = make_workload(shape, cfg.vocab_size)
    pool = {**cfg.pool_config(args.block_size, args.num_blocks),
            "backend": "cuda" if args.device.startswith("cuda") else "host"}
    t0 = time.perf_counter()
    with embedded_daemon(pool) as target, Client(target) as client:
        timeline = Timeline(client, args.max_len)
        engine = Engine.attach(client, "default", model, args.block_size,
                               config=EngineConfig(max_running=args.max_running,
                                                   max_prefill_tokens=args.prefill_chunk),
                               worker_name="blockd-demo", on_step=timeline)
        bar = ProgressBar(len(requests), enabled=not args.no_progress)
        try:
            states = engine.run(requests, progress=bar)
        finally:
            bar.close(engine)
        stats = client.stats()
        engine.close()
    seconds = time.perf_counter() - t0
    summary = summarize(args, engine, states, stats, timeline, seconds)
    if not args.no_check:
        n, worst = check_logits(model, states)
        summary["logits_checked"] = n
        summary["logits_max_abs_diff"] = worst
    summary["model"] = model_label(cfg.num_layers, cfg.seed)
    print(render(summary))
    if not args.no_plot:
        title = plot_title(summary)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        plot(timeline, args.num_blocks, args.out, title)
        args.out.with_suffix(".json").write_text(json.dumps(
            {"title": title, "summary": summary, "args": {k: str(v) for k, v in vars(args).items()},
             "steps": [asdict(r) for r in timeline.records]}, indent=1) + "\n")
        print(f"plot: {args.out}  data: {args.out.with_suffix('.json')}")
    return 0


def summarize(args: argparse.Namespace, engine: Any, states: list[Any], stats: Any,
              timeline: Timeline, seconds: float) -> dict[str, Any]:
    recs = timeline.records
    peak_saved = max(recs, key=lambda r: r.saved_blocks) if recs else None
    samples = [s for st in states for s in st.samples]
    return {
        "requests": len(states),
        "samples": len(samples),
        "prompt_tokens": sum(len(st.request.prompt) for st in states),
        "generated_tokens": sum(len(s.generated) for s in samples),
        "steps": engine.stats.steps,
        "seconds": round(seconds, 2),
        "device": args.device,
        "prefix_hit_rate": stats.prefix_hit_tokens_total / max(1,
                                                               stats.prefix_queried_tokens_total),
        "prefix_hit_tokens": stats.prefix_hit_tokens_total,
        "prefix_queried_tokens": stats.prefix_queried_tokens_total,
        "prompt_tokens_computed": engine.stats.prefill_tokens,
        "saved_blocks_peak": peak_saved.saved_blocks if peak_saved else 0,
        "saved_share_at_peak": (peak_saved.saved_blocks / peak_saved.table_blocks
                                if peak_saved and peak_saved.table_blocks else 0.0),
        "saved_share_mean": (sum(r.saved_blocks for r in recs)
                             / max(1, sum(r.table_blocks for r in recs))),
        "contiguous_waste": timeline.weighted("contiguous_waste", "contiguous"),
        "paged_waste": timeline.weighted("paged_waste", "paged"),
        "max_len": args.max_len,
        "block_size": args.block_size,
        "num_blocks": args.num_blocks,
        "peak_blocks_used": max((args.num_blocks - r.free_blocks - r.cached_blocks
                                 for r in recs), default=0),
        "peak_running": engine.stats.peak_running,
        "preemptions": engine.stats.preemptions,
        "forks": engine.stats.forks,
        "cow_copies": stats.cow_copies_total,
    }


#: What the demo serves, said wherever it reports: the shape of TinyLlama, none of its weights.
MODEL = "TinyLlama-shaped model with seeded random weights"


def model_label(num_layers: int, seed: int) -> str:
    """The model as the summary and the plot name it (the weights are random, not trained)."""
    return f"{num_layers}-layer {MODEL} (seed {seed})"


def plot_title(s: dict[str, Any]) -> str:
    return (f"blockd demo: {s['requests']} requests, {s['model']}, pool {s['num_blocks']} x "
            f"{s['block_size']} tokens ({s['device']})")


def render(s: dict[str, Any]) -> str:
    lines = [
        f"blockd demo: {s['requests']} requests ({s['samples']} samples), "
        f"{s['prompt_tokens']:,} prompt tokens, {s['generated_tokens']:,} generated, "
        f"{s['steps']} steps in {s['seconds']:.1f} s on {s['device']}",
        f"  model                  {s['model']}",
        f"  prefix hit rate        {s['prefix_hit_rate']:6.1%} of admitted prompt tokens "
        f"({s['prefix_hit_tokens']:,} of {s['prefix_queried_tokens']:,}); "
        f"{s['prompt_tokens_computed']:,} prompt tokens computed",
        f"  blocks saved by sharing {s['saved_blocks_peak']:5d} at peak "
        f"({s['saved_share_at_peak']:.0%} of the blocks the tables name), "
        f"{s['saved_share_mean']:.0%} on average",
        f"  KV waste, contiguous   {s['contiguous_waste']:6.1%} (reserving max length "
        f"{s['max_len']} per request)",
        f"  KV waste, paged        {s['paged_waste']:6.1%} (unused tail of last blocks, "
        f"block size {s['block_size']})",
        f"  peak blocks used       {s['peak_blocks_used']:6d} of {s['num_blocks']} "
        f"(peak running {s['peak_running']}); preemptions {s['preemptions']}, forks "
        f"{s['forks']}, copy-on-write copies {s['cow_copies']}",
    ]
    if "logits_checked" in s:
        lines.append(f"  logits vs contiguous no-cache forward: {s['logits_checked']:,} "
                     f"positions, max |diff| {s['logits_max_abs_diff']:.1e}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
