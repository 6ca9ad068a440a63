"""Multi-turn conversations on blockd: prompt tokens served from blockd per turn, with the answers
saved (``save_generated``, the default) and without (prompt blocks only), in one run.

Engines (each its own process, ``blockd_apps.vllm_engine``; the tests' random tiny Llama,
float32, greedy, ``enforce_eager``, ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``; vLLM's own prefix cache
OFF, so every cached token a request reports came from blockd):

- ``alone``: vLLM without connector (the tokens every engine must produce, and the TTFT of
  computing every prompt);
- ``answers``: BlockdConnector saving prompt and generated blocks;
- ``prompts``: BlockdConnector with ``"save_generated": false`` (what the connector did before).

Both connector engines use one daemon and the same conversations, each under its own
``cache_salt`` (so neither hits what the other saved). Per repetition (fresh conversations each
time; the two connector engines in alternating order): ``--conversations`` conversations of
``--turns`` turns, all conversations of a turn in one call; turn 1 is a ``--first``-token
prompt, turn n+1's prompt is turn n's prompt + its answer (``--max-tokens`` tokens) + 8..40
tokens of new user text. Per turn and engine: prompt tokens, tokens served from blockd (vLLM's
``num_cached_tokens`` per request), TTFT p50 (vLLM's ``first_token_latency``), tokens equal to
vLLM alone's. Medians (min, max) over repetitions; JSON to bench/results/vllm_multiturn.json,
plot to .png. No figure from another run is used.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "apps"))
sys.path.insert(0, str(ROOT / "bench"))

from vllm_connector import connector, start_blockd  # noqa: E402

from blockd_apps.launch import terminate  # noqa: E402
from blockd_apps.vllm_engine import Engine, tiny_model  # noqa: E402

B = 32
#: Pause before every measured call (bench/vllm_connector.py: vLLM's CPU workers spin for a
#: while after a step, and on 2 cores the engine that ran last slows the next one).
SETTLE_S = 1.0
MODES = ("answers", "prompts")


def conversations(rng: random.Random, n: int, first: int, turns: int
                  ) -> tuple[list[list[int]], list[list[list[int]]]]:
    """First prompts, and each later turn's user text, per conversation."""
    prompts = [[rng.randrange(1, 1000) for _ in range(first)] for _ in range(n)]
    users = [[[rng.randrange(1, 1000) for _ in range(rng.randrange(8, 40))]
              for _ in range(turns)] for _ in range(n)]
    return prompts, users


def call(engine: Engine, prompts: list[list[int]], max_tokens: int, salt: str | None
         ) -> dict[str, Any]:
    time.sleep(SETTLE_S)
    out = engine.generate(prompts, max_tokens=max_tokens, cache_salt=salt)
    ttft = [t for t in out["ttft_s"] if t is not None]
    return {"prompt_tokens": sum(len(p) for p in prompts), "served_tokens": sum(out["num_cached"]),
            "ttft_p50_ms": 1e3 * statistics.median(ttft), "wall_s": out["wall_s"],
            "tokens": out["tokens"]}


def repetition(rep: int, engines: dict[str, Engine], args: argparse.Namespace
               ) -> list[dict[str, Any]]:
    rng = random.Random(1000 + rep)
    prompts, users = conversations(rng, args.conversations, args.first, args.turns)
    turns = []
    previous: list[int] = []  # per conversation, prompt + answer tokens of the previous turn
    last_prompts: list[list[int]] = []
    for turn in range(args.turns):
        rec: dict[str, Any] = {"turn": turn + 1}
        base = call(engines["alone"], prompts, args.max_tokens, None)
        order = MODES if rep % 2 == 0 else MODES[::-1]
        for mode in order:
            rec[mode] = call(engines[mode], prompts, args.max_tokens, f"{mode}-{rep}")
            rec[mode]["same_tokens"] = rec[mode].pop("tokens") == base["tokens"]
        answers = base.pop("tokens")
        rec["alone"] = base
        # What each mode can get at best: every full block with K/V of the previous prompt +
        # answer (answers), every full block of the previous prompt (prompts).
        rec["bound"] = {
            "answers": sum((n - 1) // B * B for n in previous),
            "prompts": sum(len(p) // B * B for p in last_prompts),
        }
        for mode in MODES:
            rec[mode]["served_fraction"] = (rec[mode]["served_tokens"]
                                            / rec[mode]["prompt_tokens"])
        turns.append(rec)
        print(json.dumps({"rep": rep, "turn": turn + 1, **{
            m: {k: round(rec[m][k], 3) for k in ("served_tokens", "served_fraction",
                                                 "ttft_p50_ms")} for m in MODES},
            "bound": rec["bound"], "same": [rec[m]["same_tokens"] for m in MODES]}), flush=True)
        last_prompts = prompts
        previous = [len(p) + len(a) for p, a in zip(prompts, answers, strict=True)]
        prompts = [p + a + users[c][turn]
                   for c, (p, a) in enumerate(zip(prompts, answers, strict=True))]
    return turns


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--first", type=int, default=160)
    ap.add_argument("--max-tokens", type=int, default=80)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "vllm_multiturn.json")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    with tempfile.TemporaryDirectory(prefix="blockd-vllm-multiturn-") as tmp:
        work = Path(tmp)
        model = tiny_model(work / "model")
        daemon = start_blockd(work)
        engines: dict[str, Engine] = {}
        try:
            answers = connector(work)
            prompts = connector(work)
            prompts["kv_connector_extra_config"]["save_generated"] = False
            engines["alone"] = Engine(model, wait=False)
            engines["answers"] = Engine(model, answers, wait=False)
            engines["prompts"] = Engine(model, prompts, wait=False)
            for e in engines.values():
                e.ready()
            reps = [repetition(rep, engines, args) for rep in range(args.repeats)]
        finally:
            for e in engines.values():
                e.stop()
            terminate(daemon.proc)
    per_turn = []
    for t in range(args.turns):
        rows = [r[t] for r in reps]
        per_turn.append({
            "turn": t + 1,
            "prompt_tokens": summary([r["answers"]["prompt_tokens"] for r in rows]),
            **{f"{m}_served_tokens": summary([r[m]["served_tokens"] for r in rows])
               for m in MODES},
            **{f"{m}_served_fraction": summary([r[m]["served_fraction"] for r in rows])
               for m in MODES},
            **{f"{m}_bound_tokens": summary([r["bound"][m] for r in rows]) for m in MODES},
            **{f"{m}_ttft_p50_ms": summary([r[m]["ttft_p50_ms"] for r in rows])
               for m in (*MODES, "alone")},
        })
    result = {
        "what": "multi-turn conversations, vLLM (vllm-cpu 0.32.0) on blockd with the answers "
                "saved (save_generated) vs prompt blocks only, and vLLM alone; tiny random "
                "Llama, float32, greedy, 2 CPU cores, VLLM_CPU_NUM_OF_RESERVED_CPU=1, vLLM's "
                "prefix cache off (every cached token came from blockd)",
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "repetitions": reps,
        "per_turn": per_turn,
        "all_tokens_equal": all(r[m]["same_tokens"] for rep in reps for r in rep for m in MODES),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps({"per_turn": per_turn, "all_tokens_equal": result["all_tokens_equal"]},
                     indent=2))
    plot(result, args.out.with_suffix(".png"))


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["per_turn"]
    turns = [r["turn"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    labels = {"answers": "answers saved (save_generated)", "prompts": "prompt blocks only",
              "alone": "vLLM alone"}
    for i, m in enumerate(MODES):
        s = [r[f"{m}_served_fraction"] for r in rows]
        med = [x["median"] for x in s]
        err = [[x["median"] - x["min"] for x in s], [x["max"] - x["median"] for x in s]]
        a.bar([t - 0.2 + 0.4 * i for t in turns], med, width=0.4, yerr=err, capsize=3,
              label=labels[m])
    a.set_xticks(turns, [f"turn {t}" for t in turns])
    a.set_ylabel("prompt tokens served from blockd (fraction, median)")
    a.set_ylim(0, 1.05)
    a.legend(loc="upper left")
    for m in (*MODES, "alone"):
        b.plot(turns, [r[f"{m}_ttft_p50_ms"]["median"] for r in rows], "o-", label=labels[m])
    b.set_xticks(turns, [f"turn {t}" for t in turns])
    b.set_ylabel("TTFT p50, ms (median of repetitions)")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
