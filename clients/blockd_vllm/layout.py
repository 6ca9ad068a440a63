"""vLLM's KV tensors and blockd's pool, seen the same way: ``[blocks, 2, tokens, heads, dim]``.

blockd's pool is token-major: ``[layers, 2, blocks, block_size, kv_heads, head_dim]``
(``blockd_gpu.layout``). vLLM's per-layer tensors differ by backend and version:

- the CPU backend (vLLM 0.32, layout ``LBHNC``): ``[blocks, kv_heads, block_size, 2*head_dim]``,
  heads outside tokens, K and V side by side in the last axis;
- FlashAttention-style GPU backends: ``[2, blocks, block_size, kv_heads, head_dim]`` (``NHD``)
  or ``[2, blocks, kv_heads, block_size, head_dim]`` (``HND``); FlashInfer-style:
  ``[blocks, 2, ...]``.

``block_view`` recognises the form from the tensor's shape (and, only where two axes have the
same size, from vLLM's configured layout name), and returns a strided *view* of the same memory
as ``[blocks, 2, block_size, kv_heads, head_dim]``; nothing is copied and any stride order
works. A tensor of none of these forms, or of the wrong sizes, is refused at
``register_kv_caches`` with both the shape and the expected sizes named. A copy between the
two is then one gather and one scatter per layer (``copy_blocks``), the transpose of each block
included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from blockd import wire


@dataclass(frozen=True)
class KvShape:
    """What both sides must agree on: one tensor-parallel rank's share (``num_kv_heads`` is
    per rank), and how many ranks there are (the pool's ``tp_size`` shards, one per rank)."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    tp_size: int = 1

    def describe(self) -> str:
        return (f"num_layers={self.num_layers} block_size={self.block_size} "
                f"num_kv_heads={self.num_kv_heads} head_dim={self.head_dim} dtype={self.dtype}"
                + (f" tp_size={self.tp_size}" if self.tp_size != 1 else ""))


def engine_shape(vllm_config: Any) -> KvShape:
    """The KV shape vLLM's config implies (the scheduler side attaches with it; ``blockd-vllm
    layout`` prints it). A model or setting whose KV cache is not one full-attention block
    table per layer of one shape is refused with the reason (``unsupported_model``)."""
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    if pc.pipeline_parallel_size != 1 or getattr(pc, "decode_context_parallel_size", 1) != 1:
        raise ValueError(
            f"blockd_vllm: pipeline_parallel_size={pc.pipeline_parallel_size}: this connector "
            f"supports tensor parallelism (each rank its shard of the pool), not pipeline or "
            f"context parallelism (docs/vllm.md, limits)")
    why = unsupported_model(mc)
    if why:
        raise ValueError(f"blockd_vllm: model {mc.model!r} is refused: {why}")
    cache_dtype = str(cc.cache_dtype)
    if cache_dtype == "auto":  # vLLM's choice for the model (a float32 checkpoint may run
        cache_dtype = str(mc.dtype).removeprefix("torch.")  # as bfloat16 on CPU)
    try:
        dtype = wire.canonical_dtype(cache_dtype, field="kv_cache_dtype")
    except wire.WireError as err:
        raise ValueError(f"blockd_vllm: kv cache dtype {cache_dtype!r} is not one a blockd "
                         f"pool holds ({', '.join(wire.DTYPES)}): {err.problem}") from None
    return KvShape(num_layers=mc.get_num_layers(pc), block_size=cc.block_size,
                   num_kv_heads=mc.get_num_kv_heads(pc), head_dim=mc.get_head_size(),
                   dtype=dtype, tp_size=pc.tensor_parallel_size)


#: ``layer_types`` spellings of a full-attention layer (vLLM's own spellings, and the
#: transformers ones).
FULL_ATTENTION = frozenset({"attention", "full_attention"})


def unsupported_model(mc: Any) -> str:
    """Why blockd cannot hold this model's KV cache ("" when it can): blockd's pool is one
    ``[layers, 2, blocks, block_size, kv_heads, head_dim]`` tensor of full-attention K/V, and
    the connector maps vLLM's one KV-cache group onto it. Sliding-window layers (vLLM frees
    their blocks outside the window and keeps one group per kind), hybrid models (mamba or
    linear attention layers hold state, not per-token K/V), MLA (one latent per token, not K and
    V per head), attention-free and encoder-decoder models are none of that."""
    if getattr(mc, "is_attention_free", False):
        return "it has no attention layers (no KV cache to share)"
    if getattr(mc, "is_hybrid", False):
        return ("it is a hybrid model (mamba / linear-attention layers keep a state, not "
                "per-token K/V, in KV-cache groups of their own)")
    if getattr(mc, "use_mla", False):
        return ("it uses multi-head latent attention (one compressed latent per token, not K "
                "and V per KV head)")
    if getattr(mc, "is_encoder_decoder", False):
        return "it is an encoder-decoder model (cross-attention KV is per request)"
    window = mc.get_sliding_window()
    if window is not None:
        return (f"it uses sliding-window attention (sliding_window={window}): vLLM frees the "
                f"blocks outside the window, so they cannot be saved or shared "
                f"(vLLM's --disable-sliding-window runs it with full attention, its max model "
                f"length capped to the window)")
    layer_types = getattr(mc.hf_text_config, "layer_types", None) or []
    other = sorted(set(layer_types) - FULL_ATTENTION)
    if other:
        return (f"its layers are not all full attention (layer_types has {other}): vLLM keeps "
                f"one KV-cache group per kind of layer")
    return ""


def block_view(t: Any, shape: KvShape, layout_name: str | None = None) -> Any:
    """``t`` (one layer of vLLM's KV cache) as ``[blocks, 2, block_size, kv_heads, head_dim]``
    (a view). ``layout_name`` is vLLM's ``cache_config.kv_cache_layout`` (e.g. ``LBHNC``),
    consulted only when ``block_size == num_kv_heads`` leaves the shape ambiguous."""
    B, H, D = shape.block_size, shape.num_kv_heads, shape.head_dim
    dims = tuple(t.shape)
    heads_first = _heads_first(layout_name)
    if len(dims) == 4 and dims[3] == 2 * D:
        # [blocks, H, B, 2D] or [blocks, B, H, 2D]: K and V side by side in the last axis.
        if dims[1:3] == (H, B) and (H != B or heads_first is not False):
            return t.unflatten(3, (2, D)).permute(0, 3, 2, 1, 4)
        if dims[1:3] == (B, H):
            return t.unflatten(3, (2, D)).permute(0, 3, 1, 2, 4)
    elif len(dims) == 5 and dims[4] == D and 2 in dims[:2]:
        kv_first = dims[0] == 2  # [2, blocks, ...]; else [blocks, 2, ...]
        inner = dims[2:4]
        perm_blocks = (1, 0) if kv_first else (0, 1)
        if inner == (H, B) and (H != B or heads_first is True):
            return t.permute(*perm_blocks, 3, 2, 4)
        if inner == (B, H):
            return t.permute(*perm_blocks, 2, 3, 4)
    raise ValueError(
        f"blockd_vllm: vLLM's KV tensor has shape {dims}, which is none of the forms this "
        f"connector knows for {shape.describe()}: [blocks, {H}, {B}, {2 * D}] (CPU, LBHNC), "
        f"[2, blocks, {B}, {H}, {D}] (NHD), [2, blocks, {H}, {B}, {D}] (HND), or [blocks, 2, ...]")


def _heads_first(layout_name: str | None) -> bool | None:
    """Whether vLLM's layout puts heads outside tokens (``...HN...``), None when unknown."""
    if not layout_name:
        return None
    name = layout_name.upper()
    if "HN" in name:
        return True
    if "NH" in name:
        return False
    return None


def pool_view(kv_pool: Any, layer: int) -> Any:
    """One layer of blockd's pool ``[layers, 2, blocks, B, H, D]`` as ``[blocks, 2, B, H, D]``."""
    return kv_pool[layer].transpose(0, 1)


def copy_blocks(dst: Any, dst_ids: Any, src: Any, src_ids: Any) -> None:
    """``dst[dst_ids[i]] = src[src_ids[i]]`` for every i, both ``[blocks, 2, B, H, D]`` views
    (any strides). ``src`` may be on another device: the gathered blocks are moved once."""
    gathered = src.index_select(0, src_ids)
    if gathered.device != dst.device:
        gathered = gathered.to(dst.device, non_blocking=True)
    # index_copy_ rather than ``dst[dst_ids] = gathered``: the scatter into a strided view
    # without building an advanced-indexing assignment (faster here; not benchmarked in
    # bench/).
    dst.index_copy_(0, dst_ids, gathered)
