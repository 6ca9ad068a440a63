"""The atheris target fuzz/fuzz_convert.py, run without atheris on a few hundred inputs (its
seeds, random bytes, and mutated seeds), so CI exercises the harness and the conversion layer
on every run. Long campaigns use atheris itself (docs/fuzzing.md)."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

from fuzz_support import COUNTS

TARGET = Path(__file__).resolve().parents[2] / "fuzz" / "fuzz_convert.py"


def load_target():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("fuzz_convert", TARGET)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        how = rng.randrange(5)
        if how == 0 and b:
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        elif how == 1 and b:
            del b[rng.randrange(len(b)):]
        elif how == 2:
            at = rng.randrange(len(b) + 1)
            b[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif how == 3 and b:
            b[rng.randrange(len(b))] = rng.choice([0, 1, 0x7F, 0x80, 0xFF])
        else:
            b += bytes([0x32, 0x02, 0x0A, 0x00])  # StepRequest: one more (empty) operation
    return bytes(b)


def test_convert_target_smoke() -> None:
    mod = load_target()
    h = mod.Harness()
    rng = random.Random(20240601)
    seeds = mod.seed_inputs()
    corpus = Path(TARGET).parent / "corpus" / "convert"
    files = sorted(corpus.iterdir()) if corpus.is_dir() else []
    inputs = list(seeds) + [f.read_bytes() for f in files]
    inputs += [bytes(rng.randrange(256) for _ in range(rng.randint(0, 64))) for _ in range(200)]
    inputs += [mutate(rng, rng.choice(seeds)) for _ in range(400)]
    # Replays of the seeds' steps with live ids, several rounds, so state accumulates.
    inputs += seeds * 5
    for data in inputs:
        h.run(data)
    h.m.check_invariants()
    COUNTS["convert"] += len(inputs)
    assert h.inputs > len(seeds)  # most inputs parsed and ran
    assert h.m.sequences or h.errors  # the dispatch did something
