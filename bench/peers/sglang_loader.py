"""Load SGLang's own RadixCache and paged allocator from its wheel, without installing sglang.

Why not ``pip install sglang``: the package pulls its whole serving stack and pins (torch,
transformers, flashinfer...) that conflict with this venv. The cache code itself is pure Python
on torch, so ``bench/peers/fetch_sglang.sh`` downloads the wheel (``pip download --no-deps``)
and this module unpacks it under ``bench/peers/.cache/`` and puts it first on ``sys.path``.

Importing ``sglang.srt.mem_cache.radix_cache`` drags in modules the cache never calls (JSON,
notebook and model-config helpers reached through ``sglang.srt.utils``). Only those are
replaced, by :data:`STUBBED`: each stub answers any attribute with a sentinel that raises
``RuntimeError`` when called, so a stub the replay does use fails loudly instead of silently
changing what is measured. Every other module is SGLang's own file from the wheel.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import os
import sys
import types
import zipfile
from pathlib import Path

VERSION = "0.5.23"
CACHE = Path(__file__).resolve().parent / ".cache"

#: Modules the cache code's imports reach but the replay never calls, and why each is safe.
STUBBED: dict[str, str] = {
    "orjson": "not installed here; sglang.srt.utils.common imports it for JSON responses",
    "IPython": "not installed here; sglang.srt.utils.common imports it for notebook display",
    "gguf": "not installed here; a quantization loader behind sglang.srt.utils imports it",
    "sglang.srt.configs": "see REAL_SUBMODULES",
}

#: Stubbed packages some of whose submodules are real (loaded from the wheel) because the
#: replay calls them: ``sglang.srt.configs`` re-exports every model's config class (and so
#: pulls torchvision and the HF model zoo); the cache code only names the mamba state params
#: (for mamba pools) and the model config (type hints), while SGLang's default ServerArgs,
#: published for the scheduler helpers, calls ``shared_experts``.
REAL_SUBMODULES: dict[str, set[str]] = {
    "sglang.srt.configs": {"sglang.srt.configs.shared_experts"},
}


class _NeverCalled:
    """What a stub module hands out: any use beyond naming it raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: object, **kwargs: object) -> object:
        raise RuntimeError(f"bench/peers: the stub {self._name} was called; it must not be "
                           f"stubbed (see STUBBED in {__file__})")

    def __getattr__(self, name: str) -> _NeverCalled:
        if name.startswith("__"):
            raise AttributeError(name)
        return _NeverCalled(f"{self._name}.{name}")

    def __mro_entries__(self, bases: tuple[object, ...]) -> tuple[type, ...]:
        return (object,)  # a stub class used as a base class (annotation-only hierarchies)


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> _NeverCalled:
        if name.startswith("__"):
            raise AttributeError(name)
        return _NeverCalled(f"{self.__name__}.{name}")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names: set[str], real: set[str], dirs: dict[str, list[str]]) -> None:
        self.names = names
        self.real = real
        self.dirs = dirs  # a stubbed package with real submodules -> its directory
        self.hit: set[str] = set()

    def find_spec(self, name: str, path: object, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if name in self.real:
            return None  # the wheel's own file, through the normal path finder
        if name in self.names or any(name.startswith(n + ".") for n in self.names):
            self.hit.add(name)
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = self.dirs.get(spec.name, [])
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def wheel_path() -> Path | None:
    """The downloaded wheel (``BLOCKD_SGLANG_WHEEL`` overrides where to look)."""
    given = os.environ.get("BLOCKD_SGLANG_WHEEL")
    if given:
        p = Path(given)
        return p if p.is_file() else next(iter(sorted(p.glob(f"sglang-{VERSION}-*.whl"))), None)
    return next(iter(sorted(CACHE.glob(f"sglang-{VERSION}-*.whl"))), None)


def unpacked_dir() -> Path:
    return CACHE / f"sglang-{VERSION}"


def available() -> bool:
    """Whether the wheel is here (unpacked or not): the replay can run SGLang."""
    return (unpacked_dir() / "sglang" / "srt" / "mem_cache" / "radix_cache.py").is_file() \
        or wheel_path() is not None


def unpack() -> Path:
    """Unpack the wheel once; returns the directory to put on ``sys.path``."""
    dest = unpacked_dir()
    marker = dest / ".complete"
    if marker.is_file():
        return dest
    wheel = wheel_path()
    if wheel is None:
        raise FileNotFoundError(f"no sglang-{VERSION} wheel under {CACHE}: "
                                "run bench/peers/fetch_sglang.sh")
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as z:
        z.extractall(dest, [n for n in z.namelist() if n.startswith("sglang/")])
    marker.write_text(wheel.name + "\n")
    return dest


_finder: _StubFinder | None = None
_THIRD_PARTY = {n for n in STUBBED if not n.startswith("sglang")}


def load() -> types.SimpleNamespace:
    """Import SGLang's cache classes from the wheel; returns them and the stubs that were hit."""
    global _finder
    root = unpack()
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    if _finder is None:
        dirs = {name: [str(root.joinpath(*name.split(".")))] for name in REAL_SUBMODULES}
        real = set().union(*REAL_SUBMODULES.values())
        _finder = _StubFinder(set(STUBBED) | set(REAL_SUBMODULES), real, dirs)
        sys.meta_path.insert(0, _finder)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "only CUDA supports AWQ" and the like, at import
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.mem_cache import common
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
        from sglang.srt.runtime_context import get_context
        from sglang.srt.sampling.sampling_params import SamplingParams
        # The scheduler-side helpers read the process config (speculative decoding off,
        # no thinking-cache stripping): publish SGLang's own default, as its tests do.
        if not get_context().is_config_namespace_published("serving"):
            get_context().override_server_args().install()
    import sglang

    # Other libraries probe these names (matplotlib asks IPython for its REPL): once SGLang's
    # modules hold their references, the third-party stubs leave sys.modules and the finder,
    # so a later import of them anywhere fails as it would without this loader.
    for name in [n for n in sys.modules if n.split(".")[0] in _THIRD_PARTY]:
        del sys.modules[name]
    _finder.names -= _THIRD_PARTY
    return types.SimpleNamespace(
        version=getattr(sglang, "__version__", VERSION), root=root,
        RadixCache=RadixCache, RadixKey=RadixKey, CacheInitParams=CacheInitParams,
        MatchPrefixParams=MatchPrefixParams, ReqToTokenPool=ReqToTokenPool,
        PagedTokenToKVPoolAllocator=PagedTokenToKVPoolAllocator,
        Req=Req, SamplingParams=SamplingParams, common=common,
        stubs_hit=sorted(_finder.hit))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--unpack", action="store_true", help="unpack the wheel and import it")
    args = ap.parse_args()
    if args.unpack:
        ns = load()
        print(f"sglang {ns.version} from {ns.root}; stubbed: {', '.join(ns.stubs_hit)}")


if __name__ == "__main__":
    main()
