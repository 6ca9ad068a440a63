import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# The daemon launcher is shared with the server tests; e2e_support lives next to this file.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from e2e_support import MODEL_CONFIG  # noqa: E402

from blockd_apps.reference import TinyLlama  # noqa: E402


@pytest.fixture(scope="session")
def model() -> TinyLlama:
    return TinyLlama(MODEL_CONFIG)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """The tiny model's matmuls are far too small to split across threads, and on a 2-core
    machine the daemon subprocess needs a core: with torch's default (one thread per core)
    the spinning intra-op threads and the daemon contend and a step takes 20x longer."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
