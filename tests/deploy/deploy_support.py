"""Helpers for the deployment tests: paths, external tools, rendering the kustomizations.

External tools (kubectl, promtool, prometheus, the kubernetes-validate package) are skipped with
a reason when missing on a developer machine, and fail the test when CI=true (.ci/run installs
them), so CI can never pass by skipping.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
#: Every kustomization that must render: the base and the overlays (vllm: the GPU overlay with
#: the worker running `vllm serve` and the BlockdConnector; remote: the CPU overlay with the
#: remote tier on an existing Redis Cluster).
KUSTOMIZATIONS = {"base": K8S / "base", "cpu": K8S / "overlays" / "cpu",
                  "gpu": K8S / "overlays" / "gpu", "vllm": K8S / "overlays" / "vllm",
                  "remote": K8S / "overlays" / "remote"}
OVERLAYS = ("cpu", "gpu", "vllm", "remote")
#: The pool backend each kustomization's blockd config must use.
POOL_BACKEND = {"base": "host", "cpu": "host", "gpu": "cuda", "vllm": "cuda", "remote": "host"}
#: Kustomizations whose worker container is `vllm serve` (tests/deploy/test_vllm_overlay.py).
VLLM = ("vllm",)
#: Kustomizations with the remote tier (tiers.redis_nodes; tests/deploy/test_remote_overlay.py).
REMOTE = ("remote",)


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() == "true"


def missing(what: str, how: str) -> None:
    """Skip (developer machine) or fail (CI=true) because ``what`` is not installed."""
    message = f"{what} is not installed ({how})"
    if in_ci():
        pytest.fail(f"{message}; CI=true, so a missing tool is a failure, not a skip")
    pytest.skip(message)


def require_tool(name: str, how: str) -> str:
    path = shutil.which(name)
    if path is None:
        missing(f"`{name}`", how)
    assert path is not None
    return path


def require_module(name: str, how: str) -> None:
    if importlib.util.find_spec(name) is None:
        missing(f"the Python package providing `{name}`", how)


APT_HINT = "apt-get install prometheus kubectl; .ci/run does it in CI"


def render(name: str) -> list[dict[str, Any]]:
    kubectl = require_tool("kubectl", APT_HINT)
    proc = subprocess.run([kubectl, "kustomize", str(KUSTOMIZATIONS[name])],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, f"kubectl kustomize {name} failed:\n{proc.stderr}"
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d.get("kind") == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"expected exactly one {kind}, got {len(found)}"
    return found[0]


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_get(url: str, params: dict[str, str] | None = None, timeout: float = 10) -> bytes:
    """GET over loopback, never through an HTTP proxy from the environment."""
    if params:
        url += "?" + urllib.parse.urlencode(params)
    with _NO_PROXY.open(url, timeout=timeout) as resp:
        body: bytes = resp.read()
        return body


DASHBOARD = DEPLOY / "grafana" / "blockd-dashboard.json"
RULES = DEPLOY / "prometheus" / "blockd-rules.yaml"


def dashboard_queries(path: Path = DASHBOARD) -> dict[str, str]:
    """where -> PromQL (panel targets, nested rows included, and the template variables)."""
    dash = json.loads(path.read_text())
    out: dict[str, str] = {}

    def walk(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            for t in p.get("targets", []):
                out[f"panel {p['id']} {p['title']!r} {t['refId']}"] = t["expr"]
            walk(p.get("panels", []))

    walk(dash["panels"])
    for var in dash.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            query = var["query"]
            out[f"variable ${var['name']}"] = query["query"] if isinstance(query, dict) else query
    return out


def rule_queries(path: Path = RULES) -> dict[str, str]:
    out = {}
    for group in yaml.safe_load(path.read_text())["groups"]:
        for rule in group["rules"]:
            out[f"rule {rule.get('alert') or rule.get('record')}"] = rule["expr"]
    return out
