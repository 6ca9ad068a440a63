"""What decides sharing: the cache namespace of a vLLM request, derived by the connector.

A block's key in blockd hashes the namespace, the tenant's policy and the tokens. The engine's
part comes from the engine itself, never from the caller alone, so a request can only hit K/V
that this very model computed:

- ``model_id``: the served model name (vLLM's first ``served_model_name``, else ``model``);
- ``model_revision``: the caller's revision when one is set (extra config ``model_revision``,
  or vLLM's ``revision``) joined with a *fingerprint* of the weights and the model config that
  changes when the weights change even if nobody changes a revision string: for every weight
  and config file of the model directory (a local path, or the Hugging Face cache snapshot a
  hub id resolves to), its name, size, modification time and the SHA-256 of its first and last
  MiB (a safetensors file starts with its tensor table), plus the engine's quantization and the
  architecture config vLLM parsed;
- ``lora_id`` (per request): the adapter's name and a fingerprint of its files;
- ``tokenizer_digest``: a fingerprint of the tokenizer files, mode and revision;
- ``cache_salt`` (per request): vLLM's ``cache_salt``, as bytes.

The tenant is the connector's configured tenant, so every isolation property of blockd (private
prefixes, sharing groups, quotas) holds for vLLM traffic as for any worker.
"""

from __future__ import annotations

import hashlib
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

from blockd.api.v1 import blockd_pb2 as pb

#: Files whose content decides the K/V a model computes (weights, config, adapters).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".json")
#: Files that decide how text becomes token ids.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                   "special_tokens_map.json", "vocab.json", "vocab.txt", "merges.txt")
_EDGE = 1 << 20


def _file_digest(h: Any, path: Path) -> None:
    st = path.stat()
    h.update(f"{path.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    with open(path, "rb") as f:
        h.update(f.read(_EDGE))
        if st.st_size > 2 * _EDGE:
            f.seek(-_EDGE, os.SEEK_END)
            h.update(f.read(_EDGE))


def fingerprint(directory: str, names: tuple[str, ...] = (),
                suffixes: tuple[str, ...] = WEIGHT_SUFFIXES) -> str:
    """A short digest of a directory's files: those in ``names``, else those ending in
    ``suffixes`` (recursively, sorted). Empty when the directory does not exist."""
    root = Path(directory)
    if not root.is_dir():
        return ""
    h = hashlib.sha256()
    files = sorted(p for p in root.rglob("*") if p.is_file()
                   and (p.name in names if names else p.name.endswith(suffixes)))
    for p in files:
        h.update(str(p.relative_to(root)).encode() + b"\0")
        _file_digest(h, p)
    return h.hexdigest()[:32]


def resolve_dir(model: str, revision: str | None = None) -> str:
    """A local directory for ``model``: the path itself, or the Hugging Face cache snapshot
    of a hub id (no network access); "" when neither exists."""
    if os.path.isdir(model):
        return model
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return ""
    found = try_to_load_from_cache(model, "config.json", revision=revision)
    return os.path.dirname(found) if isinstance(found, str) else ""


class EngineNamespace:
    """The engine's part of every request's namespace, computed once at start."""

    def __init__(self, vllm_config: Any, revision_override: str | None = None) -> None:
        mc = vllm_config.model_config
        served = mc.served_model_name
        self.model_id = (served[0] if isinstance(served, list) and served
                         else served or mc.model)
        given = revision_override or getattr(mc, "revision", None) or ""
        h = hashlib.sha256()
        h.update(fingerprint(resolve_dir(mc.model, getattr(mc, "revision", None))).encode())
        h.update(f"\0{getattr(mc, 'quantization', None)}\0{getattr(mc, 'dtype', '')}".encode())
        hf = getattr(mc, "hf_config", None)
        if hf is not None and hasattr(hf, "to_json_string"):
            h.update(hf.to_json_string(use_diff=False).encode())
        self.weights = h.hexdigest()[:24]
        self.model_revision = f"{given}@{self.weights}" if given else self.weights
        tok_dir = resolve_dir(getattr(mc, "tokenizer", None) or mc.model,
                              getattr(mc, "tokenizer_revision", None))
        t = hashlib.sha256()
        t.update(fingerprint(tok_dir, TOKENIZER_FILES).encode())
        t.update(f"\0{getattr(mc, 'tokenizer_mode', '')}\0"
                 f"{getattr(mc, 'tokenizer_revision', '')}".encode())
        self.tokenizer_digest = t.digest()[:16]

    def for_request(self, request: Any) -> pb.CacheNamespace:
        ns = pb.CacheNamespace(model_id=self.model_id, model_revision=self.model_revision,
                               tokenizer_digest=self.tokenizer_digest)
        lora = getattr(request, "lora_request", None)
        if lora is not None:
            ns.lora_id = lora_id(lora.lora_name, getattr(lora, "lora_path", "") or "",
                                 getattr(lora, "lora_int_id", 0))
        salt = getattr(request, "cache_salt", None)
        if salt:
            ns.cache_salt = salt.encode() if isinstance(salt, str) else bytes(salt)
        return ns


@lru_cache(maxsize=256)
def lora_id(name: str, path: str, int_id: int = 0) -> str:
    """An adapter's id: its name plus a fingerprint of its files (a re-trained adapter under
    the same name never hits the old one's K/V). Computed once per vLLM adapter id, as vLLM
    loads an adapter once per ``lora_int_id``: new weights reach vLLM under a new id."""
    digest = fingerprint(path) if path else ""
    return f"{name}@{digest[:16]}" if digest else name
