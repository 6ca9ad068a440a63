"""A tiny Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU) with seeded random weights.

Two forward passes over the same weights:

- ``forward(tokens)``: the contiguous, no-cache reference. One sequence, every position at once,
  ``scaled_dot_product_attention(is_causal=True)``. What the paged path is checked against.
- ``forward_paged(batch, kv_caches)``: one scheduler step of a serving engine. Only the step's
  new tokens are projected; their K/V go into the pool slots ``reshape_and_cache``; attention
  reads every earlier token's K/V back from the pool through the block tables
  (``paged_prefill_attention`` for prompt chunks, ``paged_decode_attention`` for one token per
  sequence). Kernels: the Triton ones for CUDA tensors, their torch twins otherwise
  (``backend="auto"``).

The weights are random (seeded), so the "language" is noise; what matters is that every layer
mixes positions through attention exactly as a real decoder does, so a wrong slot, a stale
block or a missing copy-on-write changes the logits.

Shapes below: T new tokens in a step, L a sequence's length, d ``d_model``, Hq query heads,
Hkv KV heads, D ``head_dim``, V ``vocab_size``, F the SwiGLU hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from blockd_apps.reference.batch import StepBatch
from blockd_gpu import (
    KvLayout,
    paged_decode_attention,
    paged_prefill_attention,
    reshape_and_cache,
)

__all__ = ["ModelConfig", "TinyLlama"]


@dataclass(frozen=True)
class ModelConfig:
    """The model's shape. ``block_size`` is not the model's, but the pool's layout needs it."""

    vocab_size: int = 256
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    ffn_dim: int = 128
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads (GQA groups)")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even (RoPE rotates pairs)")

    def kv_layout(self, block_size: int, dtype: str = "float32") -> KvLayout:
        """The pool layout this model's K/V need (what the daemon must be configured with)."""
        return KvLayout(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
                        head_dim=self.head_dim, block_size=block_size, dtype=dtype)

    def pool_config(self, block_size: int, num_blocks: int) -> dict[str, object]:
        """The daemon config's ``pool`` section for this model (fp32 K/V)."""
        return {"block_size": block_size, "num_blocks": num_blocks,
                "num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "dtype": "float32"}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [..., d]  weight: [d]
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (Llama's "rotate half" form) at absolute ``positions``.

    x: [T, H, D]; positions: int64 [T]  ->  [T, H, D]. Both passes call this with the same
    positions, so the paged path sees bit-identical rotations.
    """
    head_dim = x.shape[-1]
    inv_freq = theta ** -(torch.arange(0, head_dim, 2, device=x.device,
                                       dtype=torch.float32) / head_dim)  # [D/2]
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None, :].to(x.dtype)  # [T, 1, D]
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None, :].to(x.dtype)
    x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class TinyLlama(torch.nn.Module):
    """Seeded random weights; ``forward`` (contiguous reference) and ``forward_paged``."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.cfg = cfg
        gen = torch.Generator().manual_seed(cfg.seed)
        d, hq, hkv, hd, f = (cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                             cfg.ffn_dim)

        def w(*shape: int) -> torch.nn.Parameter:
            # Scaled so activations stay O(1) through the layers and logits are well spread
            # (near-ties between logits would make greedy decoding fragile).
            t = torch.randn(*shape, generator=gen) / shape[0] ** 0.5
            return torch.nn.Parameter(t.to(device=device, dtype=dtype), requires_grad=False)

        def norm(n: int) -> torch.nn.Parameter:
            t = 1.0 + 0.1 * torch.randn(n, generator=gen)
            return torch.nn.Parameter(t.to(device=device, dtype=dtype), requires_grad=False)

        self.embed = torch.nn.Parameter(
            torch.randn(cfg.vocab_size, d, generator=gen).to(device=device, dtype=dtype),
            requires_grad=False)
        self.layers = torch.nn.ModuleList()
        for _ in range(cfg.num_layers):
            layer = torch.nn.Module()
            layer.attn_norm = norm(d)
            layer.wq = w(d, hq * hd)
            layer.wk = w(d, hkv * hd)
            layer.wv = w(d, hkv * hd)
            layer.wo = w(hq * hd, d)
            layer.mlp_norm = norm(d)
            layer.w_gate = w(d, f)
            layer.w_up = w(d, f)
            layer.w_down = w(f, d)
            self.layers.append(layer)
        self.final_norm = norm(d)
        self.lm_head = w(d, cfg.vocab_size)

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def _mlp(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        # x: [..., d]  ->  [..., d]
        h = rms_norm(x, layer.mlp_norm, self.cfg.norm_eps)
        return (F.silu(h @ layer.w_gate) * (h @ layer.w_up)) @ layer.w_down

    def _qkv(self, layer: torch.nn.Module, x: torch.Tensor, positions: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # x: [T, d]; positions: [T]  ->  q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]
        cfg = self.cfg
        h = rms_norm(x, layer.attn_norm, cfg.norm_eps)
        q = (h @ layer.wq).view(-1, cfg.num_heads, cfg.head_dim)
        k = (h @ layer.wk).view(-1, cfg.num_kv_heads, cfg.head_dim)
        v = (h @ layer.wv).view(-1, cfg.num_kv_heads, cfg.head_dim)
        return rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta), v

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., d]  ->  [..., V]
        return rms_norm(x, self.final_norm, self.cfg.norm_eps) @ self.lm_head

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor | list[int]) -> torch.Tensor:
        """Contiguous, no-cache reference: logits at every position of one sequence.

        tokens: int [L]  ->  logits [L, V] (row p predicts token p + 1).
        """
        cfg = self.cfg
        tokens = torch.as_tensor(tokens, dtype=torch.int64, device=self.device)
        positions = torch.arange(tokens.shape[0], device=self.device)
        x = self.embed[tokens]  # [L, d]
        for layer in self.layers:
            q, k, v = self._qkv(layer, x, positions)
            # [L, H, D] -> [1, H, L, D]; GQA: each KV head serves num_heads / num_kv_heads.
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                is_causal=True, enable_gqa=True)  # [1, Hq, L, D]
            x = x + o[0].transpose(0, 1).reshape(-1, cfg.num_heads * cfg.head_dim) @ layer.wo
            x = x + self._mlp(layer, x)
        return self._logits(x)

    @torch.no_grad()
    def forward_paged(self, batch: StepBatch,
                      kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One step over the paged pool: the new tokens' K/V are written, logits returned.

        ``batch`` packs prefill chunks first, then decode tokens (see ``StepBatch``);
        ``kv_caches`` are the pool's per-layer ``(k_cache, v_cache)`` views, each
        ``[num_blocks, block_size, Hkv, D]``. Returns logits ``[len(batch.logit_rows), V]``,
        one row per entry of ``batch.logit_rows``.
        """
        cfg = self.cfg
        x = self.embed[batch.tokens]  # [T, d]
        tp = batch.num_prefill_tokens
        out = torch.empty(x.shape[0], cfg.num_heads, cfg.head_dim, device=x.device,
                          dtype=x.dtype)  # [T, Hq, D]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            q, k, v = self._qkv(layer, x, batch.positions)
            reshape_and_cache(k, v, k_cache, v_cache, batch.slot_mapping)
            if tp:
                paged_prefill_attention(q[:tp], k_cache, v_cache, batch.prefill_tables,
                                        batch.prefill_seq_lens, batch.qo_indptr,
                                        max_q_len=batch.max_q_len, out=out[:tp])
            if tp < x.shape[0]:
                paged_decode_attention(q[tp:], k_cache, v_cache, batch.decode_tables,
                                       batch.decode_seq_lens, out=out[tp:])
            x = x + out.view(-1, cfg.num_heads * cfg.head_dim) @ layer.wo
            x = x + self._mlp(layer, x)
        return self._logits(x[batch.logit_rows])
