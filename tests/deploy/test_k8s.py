"""The Kustomize base and overlays: they render, validate offline against the Kubernetes API
schemas, and say what the daemon needs (config, credentials, sockets, probes, hardening)."""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_support import (
    KUSTOMIZATIONS,
    OVERLAYS,
    POOL_BACKEND,
    REMOTE,
    ROOT,
    VLLM,
    by_kind,
    one,
    require_module,
)

import blockd_client.requests as rq
from blockd import config as blockd_config
from blockd.runtime import tenants_file
from blockd.server.app import SERVICE_NAME
from blockd_apps import worker_health
from blockd_client import Client
from blockd_gpu import KvLayout

Docs = list[dict[str, Any]]

#: Custom resources of the Prometheus Operator. kubernetes-validate bundles only the schemas of
#: the core Kubernetes API, so for these it can only print "Couldn't find schema" and pass: they
#: are excluded from it explicitly (below) and validated structurally by this module instead.
CRD_KINDS = {("monitoring.coreos.com/v1", "PodMonitor"),
             ("monitoring.coreos.com/v1", "PrometheusRule")}
EXPECTED_KINDS = {"Deployment", "ConfigMap", "Secret", "PodDisruptionBudget", "PodMonitor",
                  "PrometheusRule", "NetworkPolicy"}
OLDEST_K8S = "1.29.0"  # native sidecars (restartable init containers) on by default
MI = 1024 * 1024
DURATION = re.compile(r"^((\d+)y)?((\d+)w)?((\d+)d)?((\d+)h)?((\d+)m)?((\d+)s)?((\d+)ms)?$")
DNS1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def quantity(q: str | int) -> float:
    """A Kubernetes resource quantity as a number (bytes for memory, cores for CPU)."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9,
             "T": 1e12, "m": 1e-3}
    m = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(q))
    assert m, f"bad quantity {q!r}"
    return float(m.group(1)) * units.get(m.group(2), 1)


def seconds(d: str) -> float:
    m = DURATION.fullmatch(d)
    assert m and d, f"bad duration {d!r}"
    mult = {1: 365 * 86400, 3: 7 * 86400, 5: 86400, 7: 3600, 9: 60, 11: 1, 13: 1e-3}
    return sum(int(m.group(i + 1)) * f for i, f in mult.items() if m.group(i + 1))


def pod_spec(docs: Docs) -> dict[str, Any]:
    return one(docs, "Deployment")["spec"]["template"]["spec"]


def container(spec: dict[str, Any], name: str, init: bool) -> dict[str, Any]:
    found = [c for c in spec.get("initContainers" if init else "containers", [])
             if c["name"] == name]
    assert len(found) == 1, f"no {'init' if init else ''}container {name!r}"
    return found[0]


def blockd_yaml(docs: Docs, tmp_path: Path) -> tuple[dict[str, Any], blockd_config.Config]:
    cm = one(docs, "ConfigMap")
    assert set(cm["data"]) == {"blockd.yaml"}
    path = tmp_path / "blockd.yaml"
    path.write_text(cm["data"]["blockd.yaml"])
    cfg = blockd_config.load(argparse.Namespace(config=str(path)), environ={})
    return yaml.safe_load(path.read_text()), cfg


def tenants_yaml(docs: Docs) -> dict[str, Any]:
    secret = one(docs, "Secret")
    assert "stringData" not in secret
    assert set(secret["data"]) == {"tenants.yaml"}
    return yaml.safe_load(base64.b64decode(secret["data"]["tenants.yaml"]))


# -- rendering and schema validation ------------------------------------------------------------

@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_kustomization_renders_every_resource(rendered: dict[str, Docs], name: str) -> None:
    docs = rendered[name]
    assert {d["kind"] for d in docs} == EXPECTED_KINDS
    for d in docs:
        assert DNS1123.match(d["metadata"]["name"]), d["metadata"]["name"]
        assert d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "blockd"


def newest_bundled_version() -> str:
    require_module("kubernetes_validate", "pip install kubernetes-validate (the dev extra)")
    from kubernetes_validate import utils

    latest = utils.latest_version()
    versions = sorted({tuple(int(x) for x in v.split(".")) for v in utils.all_versions()})
    assert tuple(int(x) for x in latest.split(".")) == versions[-1]
    assert tuple(int(x) for x in OLDEST_K8S.split(".")) in versions
    return latest


def kubernetes_validate(path: Path, version: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict",
                           "--kubernetes-version", version, str(path)],
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize("which", ["oldest", "newest"])
@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_manifests_validate_strictly(rendered: dict[str, Docs], name: str, which: str,
                                     tmp_path: Path) -> None:
    version = OLDEST_K8S if which == "oldest" else newest_bundled_version()
    require_module("kubernetes_validate", "pip install kubernetes-validate (the dev extra)")
    core = [d for d in rendered[name] if (d["apiVersion"], d["kind"]) not in CRD_KINDS]
    crds = [d for d in rendered[name] if (d["apiVersion"], d["kind"]) in CRD_KINDS]
    assert len(core) + len(crds) == len(rendered[name])
    assert {d["kind"] for d in crds} == {"PodMonitor", "PrometheusRule"}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump_all(core, sort_keys=False))
    proc = kubernetes_validate(path, version)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    short = ".".join(version.split(".")[:2])
    for d in core:
        want = f"passed for resource {d['kind'].lower()}/{d['metadata']['name']} "
        assert want in out and f"against version {short}" in out, out
    assert "WARN" not in out and "ERROR" not in out, out


def test_strict_validation_rejects_unknown_fields(rendered: dict[str, Docs],
                                                   tmp_path: Path) -> None:
    """A control: the validator really checks (a typo in a container is caught)."""
    version = newest_bundled_version()
    deployment = yaml.safe_load(yaml.safe_dump(one(rendered["cpu"], "Deployment")))
    deployment["spec"]["template"]["spec"]["initContainers"][0]["restartPolcy"] = "Always"
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(deployment))
    proc = kubernetes_validate(path, version)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "restartPolcy" in proc.stdout + proc.stderr


# -- the CRDs, structurally (kubernetes-validate has no schema for them) -----------------------

def _str_map(value: Any, where: str) -> None:
    assert isinstance(value, dict), where
    for k, v in value.items():
        assert isinstance(k, str) and isinstance(v, str), f"{where}: {k!r}: {v!r} not a string"


def check_metadata(doc: dict[str, Any]) -> None:
    assert set(doc) == {"apiVersion", "kind", "metadata", "spec"}, sorted(doc)
    assert set(doc["metadata"]) <= {"name", "namespace", "labels", "annotations"}
    assert DNS1123.match(doc["metadata"]["name"])
    _str_map(doc["metadata"].get("labels", {}), "labels")


def check_podmonitor(pm: dict[str, Any], docs: Docs) -> None:
    check_metadata(pm)
    spec = pm["spec"]
    assert set(spec) <= {"selector", "podMetricsEndpoints", "namespaceSelector", "jobLabel",
                         "podTargetLabels", "sampleLimit", "targetLimit"}, sorted(spec)
    assert set(spec["selector"]) <= {"matchLabels", "matchExpressions"}
    _str_map(spec["selector"]["matchLabels"], "selector.matchLabels")
    pod = one(docs, "Deployment")["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items(), "selects no Pod"
    ports = {p["name"]: p["containerPort"]
             for c in pod["spec"].get("initContainers", []) + pod["spec"]["containers"]
             for p in c.get("ports", []) if "name" in p}
    endpoints = spec["podMetricsEndpoints"]
    assert isinstance(endpoints, list) and endpoints
    for ep in endpoints:
        assert set(ep) <= {"port", "path", "interval", "scrapeTimeout", "scheme", "honorLabels",
                           "relabelings", "metricRelabelings"}, sorted(ep)
        assert ep["port"] in ports, f"PodMonitor port {ep['port']!r} is no named container port"
        assert ep.get("path", "/metrics") == "/metrics"  # what blockd serves
        interval, timeout = seconds(ep["interval"]), seconds(ep["scrapeTimeout"])
        assert 0 < timeout <= interval
    return None


def check_prometheusrule(pr: dict[str, Any]) -> None:
    check_metadata(pr)
    assert set(pr["spec"]) == {"groups"}
    names = set()
    for group in pr["spec"]["groups"]:
        assert set(group) <= {"name", "interval", "rules", "limit"}, sorted(group)
        assert group["name"] not in names
        names.add(group["name"])
        assert group["rules"]
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "record", "expr", "for", "keep_firing_for", "labels",
                                 "annotations"}, sorted(rule)
            assert ("alert" in rule) != ("record" in rule)
            assert isinstance(rule["expr"], str) and rule["expr"].strip()
            if "for" in rule:
                seconds(rule["for"])
            _str_map(rule.get("labels", {}), f"{rule.get('alert')} labels")
            _str_map(rule.get("annotations", {}), f"{rule.get('alert')} annotations")
            if "alert" in rule:
                assert rule["labels"]["severity"] in {"info", "warning", "critical"}
                assert {"summary", "description"} <= set(rule["annotations"])


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_prometheus_operator_resources_are_well_formed(rendered: dict[str, Docs],
                                                       name: str) -> None:
    check_podmonitor(one(rendered[name], "PodMonitor"), rendered[name])
    check_prometheusrule(one(rendered[name], "PrometheusRule"))


def test_structural_checks_catch_mistakes(rendered: dict[str, Docs]) -> None:
    docs = rendered["cpu"]
    pm = yaml.safe_load(yaml.safe_dump(one(docs, "PodMonitor")))
    pm["spec"]["podMetricsEndpoints"][0]["port"] = "http-metrics"
    with pytest.raises(AssertionError, match="no named container port"):
        check_podmonitor(pm, docs)
    pr = yaml.safe_load(yaml.safe_dump(one(docs, "PrometheusRule")))
    pr["spec"]["groups"][0]["rules"][0]["for"] = "ten minutes"
    with pytest.raises(AssertionError, match="bad duration"):
        check_prometheusrule(pr)


# -- what the daemon reads: config and tenants ----------------------------------------------

@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_configmap_is_a_complete_valid_blockd_config(rendered: dict[str, Docs], name: str,
                                                     tmp_path: Path) -> None:
    raw, cfg = blockd_yaml(rendered[name], tmp_path)
    # Every section and key of blockd/config.py, no more, no less.
    want = {f.name: {g.name for g in dataclasses.fields(f.default_factory())}  # type: ignore[misc]
            for f in dataclasses.fields(blockd_config.Config)}
    assert set(raw) == set(want), f"sections: {sorted(set(raw) ^ set(want))}"
    for section, keys in want.items():
        assert set(raw[section]) == keys, f"{section}: {sorted(set(raw[section]) ^ keys)}"
    cfg.pool.spec()  # the pool layout itself is valid
    assert cfg.pool.backend == POOL_BACKEND[name]
    assert cfg.tenants.file and not cfg.tenants.allow_anonymous


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_secret_holds_parseable_tenants_with_hashes_only(rendered: dict[str, Docs], name: str,
                                                         tmp_path: Path) -> None:
    data = tenants_yaml(rendered[name])
    parsed = tenants_file.parse(data, "Secret blockd-tenants")
    assert parsed.tenants and parsed.workers
    for w in data["workers"]:
        assert set(w) <= {"name", "token_sha256", "tenants", "admin"}, sorted(w)
        assert re.fullmatch(r"[0-9a-f]{64}", w["token_sha256"])
    _, cfg = blockd_yaml(rendered[name], tmp_path)
    for t in parsed.tenants:
        assert t.quota_blocks <= cfg.pool.num_blocks, t.tenant_id
    # KV events are on: the worker's tenant must be shared, or the unauthenticated stream
    # carries no token ids and a router keying blocks by them can use none.
    worker = [w for w in parsed.workers if not w.admin]
    assert worker
    shared = {t.tenant_id for t in parsed.tenants if t.sharing.value != "private"}
    assert all(w.tenants and w.tenants <= shared for w in worker), "a private worker tenant"


# -- the Pod ---------------------------------------------------------------------------------

def mounts(c: dict[str, Any]) -> dict[str, str]:
    return {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_blockd_is_a_native_sidecar_gating_the_worker(rendered: dict[str, Docs], name: str,
                                                      tmp_path: Path) -> None:
    spec = pod_spec(rendered[name])
    _, cfg = blockd_yaml(rendered[name], tmp_path)
    blockd = container(spec, "blockd", init=True)
    worker = container(spec, "worker", init=False)
    assert blockd["restartPolicy"] == "Always"
    assert len(spec["initContainers"]) == 1  # nothing else runs before blockd is up
    grpc_port = int(cfg.server.tcp_address.rpartition(":")[2])
    ports = {p["name"]: p["containerPort"] for p in blockd["ports"]}
    assert ports["grpc"] == grpc_port
    metrics_port = int(cfg.metrics.address.rpartition(":")[2])
    assert ports["metrics"] == metrics_port
    # The kubelet's grpc: probes speak no TLS, and gRPC on the Pod IP is TLS: the probes ask
    # /healthz on the metrics port (the Pod IP: 0.0.0.0), opened once gRPC serves, 503 on drain.
    assert cfg.metrics.address.startswith("0.0.0.0:"), "kubelet probes dial the Pod IP"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert blockd[probe]["httpGet"] == {"path": "/healthz", "port": metrics_port}, probe
        assert "exec" not in blockd[probe] and "grpc" not in blockd[probe]
    startup = blockd["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 60
    # Config and credentials are where the daemon's config says.
    volumes = {v["name"]: v for v in spec["volumes"]}
    config_dir = str(Path(blockd["args"][blockd["args"].index("--config") + 1]).parent)
    assert mounts(blockd)["blockd-config"] == config_dir
    assert mounts(blockd)["blockd-tenants"] == str(Path(cfg.tenants.file).parent)
    assert "blockd-tenants" not in mounts(worker), "the worker never sees the tenants file"
    generated = {(d["kind"], d["metadata"]["name"]) for d in rendered[name]}
    assert ("ConfigMap", volumes["blockd-config"]["configMap"]["name"]) in generated
    assert ("Secret", volumes["blockd-tenants"]["secret"]["secretName"]) in generated
    # The sockets live on an emptyDir both containers mount at the same path.
    run_dir = mounts(blockd)["blockd-run"]
    assert "emptyDir" in volumes["blockd-run"]
    assert mounts(worker)["blockd-run"] == run_dir
    for path in (cfg.server.unix_socket, cfg.server.handle_socket):
        assert str(Path(path).parent) == run_dir
    env = {e["name"]: e for e in worker["env"]}
    assert env["BLOCKD_TARGET"]["value"] == f"unix:{cfg.server.unix_socket}"
    assert env["BLOCKD_HANDLE_SOCKET"]["value"] == cfg.server.handle_socket
    # Shutdown: the Pod's grace period covers blockd's drain.
    assert spec["terminationGracePeriodSeconds"] > cfg.server.grace_seconds + 5


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_pod_is_hardened(rendered: dict[str, Docs], name: str) -> None:
    spec = pod_spec(rendered[name])
    pod_sc = spec["securityContext"]
    assert pod_sc["runAsNonRoot"] is True and pod_sc["runAsUser"] > 0
    assert pod_sc["seccompProfile"]["type"] == "RuntimeDefault"
    for key in ("hostIPC", "hostPID", "hostNetwork", "shareProcessNamespace"):
        assert not spec.get(key), key
    assert spec["automountServiceAccountToken"] is False
    assert not [v for v in spec["volumes"] if "hostPath" in v]
    for c in spec["initContainers"] + spec["containers"]:
        sc = c["securityContext"]
        assert sc["runAsNonRoot"] is True, c["name"]
        assert sc["readOnlyRootFilesystem"] is True, c["name"]
        assert sc["allowPrivilegeEscalation"] is False, c["name"]
        assert sc["capabilities"] == {"drop": ["ALL"]}, c["name"]
        assert sc["seccompProfile"]["type"] == "RuntimeDefault", c["name"]
        assert not sc.get("privileged"), c["name"]
        assert "memory" in c["resources"]["limits"], c["name"]
        assert c["resources"]["requests"]["memory"] == c["resources"]["limits"]["memory"]
        assert "cpu" in c["resources"]["requests"], c["name"]


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_shm_and_memory_are_sized_for_the_pool(rendered: dict[str, Docs], name: str,
                                               tmp_path: Path) -> None:
    spec = pod_spec(rendered[name])
    _, cfg = blockd_yaml(rendered[name], tmp_path)
    pool_bytes = cfg.pool.spec().pool_bytes * cfg.pool.tp_size
    # The host tier is reserved at start (a file in state.dir with crash recovery, else a
    # memfd): in blockd's memory cgroup either way. The remote tier queues up to
    # remote_queue_blocks values of one block each for the cluster, in blockd's own memory.
    tier_bytes = cfg.tiers.host_bytes
    queue_bytes = (cfg.tiers.remote_queue_blocks * cfg.pool.spec().slot_bytes
                   if cfg.tiers.redis_nodes else 0)
    volumes = {v["name"]: v for v in spec["volumes"]}
    shm = volumes["dshm"]["emptyDir"]
    assert shm["medium"] == "Memory"
    for c in spec["initContainers"] + spec["containers"]:
        assert mounts(c)["dshm"] == "/dev/shm", c["name"]
    blockd = container(spec, "blockd", init=True)
    limit = quantity(blockd["resources"]["limits"]["memory"])
    if cfg.pool.backend == "host":
        # The pool is a file in state.dir, on blockd's own Memory emptyDir (so it survives a
        # restart of the blockd container), charged to blockd's memory cgroup.
        state = volumes["blockd-state"]["emptyDir"]
        assert state["medium"] == "Memory"
        assert quantity(state["sizeLimit"]) >= pool_bytes + tier_bytes + 64 * MI
        mount = mounts(blockd)["blockd-state"]
        assert cfg.state.dir.startswith(mount + "/") and cfg.state.dir != mount
        assert "blockd-state" not in mounts(container(spec, "worker", init=False))
        assert limit >= pool_bytes + tier_bytes + queue_bytes + 256 * MI
        assert quantity(shm["sizeLimit"]) >= 64 * MI
    else:
        assert cfg.state.dir == ""
        assert quantity(shm["sizeLimit"]) >= 64 * MI
        assert limit >= tier_bytes + queue_bytes + 512 * MI


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_disruption_budget_and_selectors(rendered: dict[str, Docs], name: str) -> None:
    docs = rendered[name]
    deployment = one(docs, "Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= labels.items()
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"] == selector
    assert pdb["spec"]["maxUnavailable"] == 1
    assert deployment["spec"]["replicas"] >= 2


@pytest.mark.parametrize("name", OVERLAYS)
def test_overlay_images(rendered: dict[str, Docs], name: str) -> None:
    spec = pod_spec(rendered[name])
    image = container(spec, "blockd", init=True)["image"]
    assert image.endswith("-" + POOL_BACKEND[name].replace("host", "cpu")), image
    for c in spec["initContainers"] + spec["containers"]:
        assert ":" in c["image"].rsplit("/", 1)[-1], f"{c['name']}: an explicit tag"


def gpu_requests(c: dict[str, Any]) -> int:
    res = c.get("resources", {})
    limits = int(res.get("limits", {}).get("nvidia.com/gpu", 0))
    requests = int(res.get("requests", {}).get("nvidia.com/gpu", limits))
    assert requests == limits, c["name"]
    return limits


@pytest.mark.parametrize("name", [n for n in KUSTOMIZATIONS if POOL_BACKEND[n] == "cuda"])
def test_the_gpu_overlay_shares_one_gpu_by_fd(rendered: dict[str, Docs], name: str) -> None:
    spec = pod_spec(rendered[name])
    blockd = container(spec, "blockd", init=True)
    worker = container(spec, "worker", init=False)
    # One GPU per Pod, requested by the pool's owner; two requests would be two different GPUs.
    assert gpu_requests(blockd) == 1
    assert sum(gpu_requests(c) for c in spec["initContainers"] + spec["containers"]) == 1
    env = {e["name"]: e.get("value") for e in worker["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert spec["nodeSelector"]["nvidia.com/gpu.count"] == "1"
    assert one(rendered[name], "Deployment")["spec"]["strategy"]["rollingUpdate"][
        "maxSurge"] == 0
    # The fd crosses over the Unix socket: no host namespaces, nothing privileged.
    for key in ("hostIPC", "hostPID", "shareProcessNamespace"):
        assert not spec.get(key)
    patch = (ROOT / "deploy" / "k8s" / "overlays" / "gpu" / "gpu-patch.yaml").read_text()
    assert "NOT verified" in patch


def test_cpu_overlay_has_no_gpu(rendered: dict[str, Docs]) -> None:
    for name in ("base", "cpu"):
        spec = pod_spec(rendered[name])
        assert all(gpu_requests(c) == 0 for c in spec["initContainers"] + spec["containers"])
        assert "nodeSelector" not in spec
        assert all("NVIDIA" not in e["name"] for c in spec["containers"]
                   for e in c.get("env", []))
        assert by_kind(rendered[name], "Deployment")


TLS_SECRET = "blockd-tls"


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_grpc_off_loopback_is_tls_from_a_secret_the_operator_creates(
        rendered: dict[str, Docs], name: str, tmp_path: Path) -> None:
    """blockd refuses plaintext TCP off loopback: the manifests' 0.0.0.0 listener has a
    certificate and key from the kubernetes.io/tls Secret blockd-tls, mounted read-only into
    blockd only, never rendered from git (no private key is committed)."""
    spec = pod_spec(rendered[name])
    _, cfg = blockd_yaml(rendered[name], tmp_path)
    assert cfg.server.tcp_address.startswith("0.0.0.0:")
    blockd = container(spec, "blockd", init=True)
    worker = container(spec, "worker", init=False)
    volume = {v["name"]: v for v in spec["volumes"]}["blockd-tls"]
    assert volume["secret"]["secretName"] == TLS_SECRET
    mode = volume["secret"]["defaultMode"]
    assert not mode & 0o227, oct(mode)  # writable by nobody, not world-readable
    mount = [m for m in blockd["volumeMounts"] if m["name"] == "blockd-tls"]
    assert len(mount) == 1 and mount[0].get("readOnly") is True
    for path in (cfg.server.tls_cert, cfg.server.tls_key):
        assert str(Path(path).parent) == mount[0]["mountPath"], path
    assert {Path(cfg.server.tls_cert).name, Path(cfg.server.tls_key).name} == {"tls.crt",
                                                                              "tls.key"}
    assert "blockd-tls" not in mounts(worker), "the worker uses the Unix socket"
    assert ("Secret", TLS_SECRET) not in {(d["kind"], d["metadata"]["name"])
                                          for d in rendered[name]}
    assert cfg.server.socket_mode == "0660"  # the worker reaches the sockets by its group


def self_signed(directory: Path) -> tuple[Path, Path]:
    """A throwaway certificate and key for 127.0.0.1 (the Secret blockd-tls in a real Pod)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "blockd-test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1)).sign(key, hashes.SHA256()))
    crt, pem_key = directory / "tls.crt", directory / "tls.key"
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem_key.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                          serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    pem_key.chmod(0o600)
    return crt, pem_key


# -- the worker: its token file and its probes -----------------------------------------------

TOKEN_SECRET = "blockd-worker-token"


def token_volume(spec: dict[str, Any], worker: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(the token file's path in the worker, the projected volume it comes from)."""
    env = {e["name"]: e for e in worker["env"]}
    path = env["BLOCKD_TOKEN_FILE"]["value"]
    mount = [m for m in worker["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    assert len(mount) == 1, f"BLOCKD_TOKEN_FILE {path} is on no (or several) mounts"
    assert mount[0].get("readOnly") is True
    # A subPath mount is never updated by the kubelet: a rotated Secret would not arrive.
    assert "subPath" not in mount[0] and "subPathExpr" not in mount[0]
    volume = {v["name"]: v for v in spec["volumes"]}[mount[0]["name"]]
    return path[len(mount[0]["mountPath"]) + 1:], volume


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_the_worker_token_is_a_projected_secret_file(rendered: dict[str, Docs],
                                                     name: str) -> None:
    spec = pod_spec(rendered[name])
    worker = container(spec, "worker", init=False)
    # No credential in any container's environment (the old BLOCKD_TOKEN secretKeyRef).
    for c in spec["initContainers"] + spec["containers"]:
        assert "envFrom" not in c, c["name"]
        for e in c.get("env", []):
            assert "secretKeyRef" not in e.get("valueFrom", {}), (c["name"], e["name"])
            assert e["name"] != "BLOCKD_TOKEN", c["name"]
    relpath, volume = token_volume(spec, worker)
    sources = volume["projected"]["sources"]
    assert sources == [{"secret": {"name": TOKEN_SECRET,
                                   "items": [{"key": "token", "path": relpath}]}}]
    mode = volume["projected"]["defaultMode"]
    # Read by the Pod's group (fsGroup 10001, the worker's GID), writable by nobody, not world.
    assert mode & 0o040 and not mode & 0o227, oct(mode)
    assert spec["securityContext"]["fsGroup"] == worker.get("securityContext", {}).get(
        "runAsGroup", spec["securityContext"]["runAsGroup"])
    # Only the worker mounts it; the operator creates the Secret (never rendered from git).
    blockd = container(spec, "blockd", init=True)
    assert volume["name"] not in mounts(blockd)
    assert ("Secret", TOKEN_SECRET) not in {(d["kind"], d["metadata"]["name"])
                                            for d in rendered[name]}


def probe_argv(probe: dict[str, Any]) -> list[str]:
    assert set(probe) & {"exec", "grpc", "httpGet", "tcpSocket"} == {"exec"}, sorted(probe)
    argv: list[str] = probe["exec"]["command"]
    assert argv[:3] == ["python3", "-m", worker_health.__name__], argv
    return argv[3:]


#: The worker probes that run worker_health. vLLM's startup and readiness are its own HTTP
#: /health (vllm-patch.yaml says why; tests/deploy/test_vllm_overlay.py checks them).
WORKER_HEALTH_PROBES = {name: (("livenessProbe",) if name in VLLM else
                               ("startupProbe", "readinessProbe", "livenessProbe"))
                        for name in KUSTOMIZATIONS}


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_the_worker_probes_run_the_worker_health_command(rendered: dict[str, Docs], name: str,
                                                         tmp_path: Path) -> None:
    spec = pod_spec(rendered[name])
    _, cfg = blockd_yaml(rendered[name], tmp_path)
    worker = container(spec, "worker", init=False)
    kinds = {}
    for probe in WORKER_HEALTH_PROBES[name]:
        argv = probe_argv(worker[probe])
        args = worker_health.parser().parse_args(argv)
        kinds[probe] = args.kind
        # The command's own deadline ends before the kubelet gives up on it.
        assert args.timeout + 1 <= worker[probe]["timeoutSeconds"], probe
        # Target and token file come from the container's environment, as the engine's do.
        assert not {"--target", "--token-file"} & set(argv), argv
    assert kinds == {p: "live" if p == "livenessProbe" else "ready"
                     for p in WORKER_HEALTH_PROBES[name]}
    assert worker_health.SERVICE == SERVICE_NAME  # what blockd turns NOT_SERVING on drain
    env = {e["name"]: e.get("value") for e in worker["env"]}
    assert env["BLOCKD_TARGET"] == f"unix:{cfg.server.unix_socket}"  # the Unix socket, no TCP
    startup, live = worker["startupProbe"], worker["livenessProbe"]
    # Loading a model takes minutes; liveness tolerates several missed leases (a worker
    # re-attaching after a blockd restart) before it calls the worker dead.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
    assert "livenessProbe" in WORKER_HEALTH_PROBES[name]
    assert live["periodSeconds"] * live["failureThreshold"] >= 3 * cfg.lease.default_ms / 1000
    assert worker["readinessProbe"]["failureThreshold"] >= 2


# -- KV events -------------------------------------------------------------------------------

DOWNWARD = {"POD_NAME": "metadata.name", "POD_IP": "status.podIP"}


def bound_port(endpoint: str, key: str) -> int:
    m = re.fullmatch(r"tcp://\*:(\d+)", endpoint)
    assert m, f"{key} {endpoint!r}: not bound on every interface with a fixed port"
    return int(m.group(1))


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_kv_events_are_on_with_the_downward_api(rendered: dict[str, Docs], name: str,
                                                tmp_path: Path) -> None:
    spec = pod_spec(rendered[name])
    _, cfg = blockd_yaml(rendered[name], tmp_path)
    ev = cfg.events
    assert not ev.zmq_connect and ev.wire_format == "vllm"
    blockd = container(spec, "blockd", init=True)
    ports = {p["name"]: p for p in blockd["ports"]}
    assert ports["kv-events"]["containerPort"] == bound_port(ev.zmq_endpoint, "events.zmq_endpoint")
    assert ports["kv-replay"]["containerPort"] == bound_port(ev.replay_endpoint,
                                                             "events.replay_endpoint")
    assert {p["protocol"] for p in blockd["ports"]} == {"TCP"}
    assert len({p["containerPort"] for p in blockd["ports"]}) == len(blockd["ports"])
    env = {e["name"]: e for e in blockd["env"]}
    for var, field_path in DOWNWARD.items():
        assert env[var]["valueFrom"] == {"fieldRef": {"fieldPath": field_path}}, var
    # The default topic, as the Pod's downward API fills it in; without a model (the CPU
    # overlay, whose pool is no real model's), vLLM's default empty topic.
    assert ev.topic == "" and not ev.pod_id
    pod = {"POD_NAME": "blockd-inference-7d9f-x2x1q", "POD_IP": "10.4.2.17"}
    assert ev.resolved_topic(pod) == (f"kv@10.4.2.17@{ev.model_name}" if ev.model_name else "")
    assert bool(ev.model_name) == (name in ("gpu", "vllm"))


# -- the NetworkPolicy -------------------------------------------------------------------------

PROMETHEUS = (("kubernetes.io/metadata.name", "monitoring"),
              ("app.kubernetes.io/name", "prometheus"))
SUBSCRIBER = (("blockd.dev/kv-events", "subscriber"),)


def peer_key(peer: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """A ``from`` entry as its label requirements: namespace labels (AND) pod labels; a pod
    selector alone means this namespace. Anything broader is refused."""
    assert set(peer) <= {"namespaceSelector", "podSelector"}, f"peer {peer}: ipBlock or unknown"
    for key in ("namespaceSelector", "podSelector"):
        if key in peer:
            sel = peer[key]
            assert set(sel) == {"matchLabels"} and sel["matchLabels"], \
                f"{key} {sel}: an empty selector matches every {key[:-8]}"
    assert "podSelector" in peer, f"peer {peer}: every Pod of the namespaces it selects"
    return tuple(sorted(peer.get("namespaceSelector", {}).get("matchLabels", {}).items())) + \
        tuple(sorted(peer["podSelector"]["matchLabels"].items()))


def check_network_policy(np: dict[str, Any], docs: Docs, cfg: blockd_config.Config
                         ) -> dict[int, set[tuple[tuple[str, str], ...]]]:
    """Port -> the peers allowed to reach it; asserts the policy is that narrow and covers
    every port blockd listens on."""
    spec = np["spec"]
    pod = one(docs, "Deployment")["spec"]["template"]
    assert spec["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items(), \
        "selects no inference Pod"
    assert spec["policyTypes"] == ["Ingress"]
    table: dict[int, set[tuple[tuple[str, str], ...]]] = {}
    for i, rule in enumerate(spec["ingress"]):
        assert rule.get("from"), f"ingress[{i}] allows every source"
        assert rule.get("ports"), f"ingress[{i}] allows every port"
        for port in rule["ports"]:
            assert isinstance(port["port"], int), f"ingress[{i}]: a named port {port['port']!r}"
            assert port.get("protocol", "TCP") == "TCP" and "endPort" not in port
            for peer in rule["from"]:
                table.setdefault(port["port"], set()).add(peer_key(peer))
    listening = {int(cfg.server.tcp_address.rpartition(":")[2]),
                 int(cfg.metrics.address.rpartition(":")[2]),
                 bound_port(cfg.events.zmq_endpoint, "events.zmq_endpoint"),
                 bound_port(cfg.events.replay_endpoint, "events.replay_endpoint")}
    served = engine_port(container(pod["spec"], "worker", init=False))
    if served is not None:
        listening.add(served)
    containers = pod["spec"]["initContainers"] + pod["spec"]["containers"]
    declared = {p["containerPort"] for c in containers for p in c.get("ports", [])}
    assert set(table) <= declared == listening, (sorted(table), sorted(declared))
    return table


#: The base's ingress policy; the remote overlay adds an egress-only one
#: (tests/deploy/test_remote_overlay.py checks it).
INGRESS_POLICY, EGRESS_POLICY = "blockd-inference", "blockd-inference-remote-egress"


def ingress_policy(docs: Docs) -> dict[str, Any]:
    """The ingress NetworkPolicy; asserts the only other one is the remote tier's egress."""
    policies = {d["metadata"]["name"]: d for d in by_kind(docs, "NetworkPolicy")}
    assert INGRESS_POLICY in policies, sorted(policies)
    assert set(policies) - {INGRESS_POLICY} <= {EGRESS_POLICY}, sorted(policies)
    return policies[INGRESS_POLICY]


def engine_port(worker: dict[str, Any]) -> int | None:
    """The port ``vllm serve`` listens on (its --port argument), None for other workers."""
    if worker.get("command", [])[:2] != ["vllm", "serve"]:
        return None
    ports = [a.removeprefix("--port=") for a in worker["args"] if a.startswith("--port=")]
    assert len(ports) == 1, "vllm serve: exactly one --port=N"
    return int(ports[0])


#: Who may call vLLM's OpenAI API (the vllm overlay's networkpolicy-patch.yaml).
API_CLIENT = (("blockd.dev/openai-api", "client"),)


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_network_policy_admits_only_prometheus_and_kv_event_subscribers(
        rendered: dict[str, Docs], name: str, tmp_path: Path) -> None:
    _, cfg = blockd_yaml(rendered[name], tmp_path)
    table = check_network_policy(ingress_policy(rendered[name]), rendered[name], cfg)
    egress = {d["metadata"]["name"] for d in by_kind(rendered[name], "NetworkPolicy")} - {
        INGRESS_POLICY}
    assert egress == ({EGRESS_POLICY} if name in REMOTE else set()), egress
    grpc_port = int(cfg.server.tcp_address.rpartition(":")[2])
    served = engine_port(container(pod_spec(rendered[name]), "worker", init=False))
    assert (served is not None) == (name in VLLM)
    engine = {} if served is None else {served: {API_CLIENT, PROMETHEUS}}  # API and /metrics
    assert table == engine | {
        int(cfg.metrics.address.rpartition(":")[2]): {PROMETHEUS},
        bound_port(cfg.events.zmq_endpoint, ""): {SUBSCRIBER},
        bound_port(cfg.events.replay_endpoint, ""): {SUBSCRIBER},
        # gRPC: subscribers with a credential (WatchEvents); the kubelet's probes come from the
        # node and the worker uses the Unix socket, which no policy governs.
        grpc_port: {SUBSCRIBER},
    }


def test_network_policy_checks_catch_mistakes(rendered: dict[str, Docs], tmp_path: Path) -> None:
    docs = rendered["cpu"]
    _, cfg = blockd_yaml(docs, tmp_path)
    original = ingress_policy(docs)

    def mutated(change: Any) -> dict[str, Any]:
        np: dict[str, Any] = yaml.safe_load(yaml.safe_dump(original))
        change(np["spec"])
        return np

    cases = {
        "allows every source": lambda s: s["ingress"][0].pop("from"),
        "allows every port": lambda s: s["ingress"][1].pop("ports"),
        "an empty selector": lambda s: s["ingress"][1]["from"].append({"podSelector": {}}),
        "ipBlock": lambda s: s["ingress"][0]["from"].append({"ipBlock": {"cidr": "0.0.0.0/0"}}),
        "every Pod of the namespaces": lambda s: s["ingress"][0]["from"][0].pop("podSelector"),
        "a named port": lambda s: s["ingress"][0]["ports"].append({"port": "metrics"}),
        "selects no inference Pod": lambda s: s["podSelector"]["matchLabels"].update(x="y"),
    }
    for why, change in cases.items():
        with pytest.raises(AssertionError, match=why):
            check_network_policy(mutated(change), docs, cfg)
    # A wider peer on a port passes the structure but not the table.
    np = mutated(lambda s: s["ingress"][0]["ports"].append({"port": 5557, "protocol": "TCP"}))
    assert check_network_policy(np, docs, cfg)[5557] == {PROMETHEUS, SUBSCRIBER}


# -- a real daemon from the rendered manifests ---------------------------------------------------

WORKER_TOKEN = "worker-token-for-this-test-only"


@dataclass
class Booted:
    proc: subprocess.Popen[str]
    env: dict[str, str]
    config: Path
    endpoints: dict[str, str]


@contextlib.contextmanager
def boot(docs: Docs, tmp_path: Path, tenants: bytes | None = None,
         extra_env: dict[str, str] | None = None) -> Iterator[Booted]:
    """blockd from a kustomization's ConfigMap and Secret, as mounted. Only what cannot exist
    outside a Pod is overridden, through the daemon's own BLOCKD_* environment: socket and
    tenants paths, loopback ports, a small pool; POD_NAME and POD_IP as the downward API sets
    them; and ``extra_env``."""
    tmp_path.mkdir(exist_ok=True)
    config = tmp_path / "blockd.yaml"
    config.write_text(one(docs, "ConfigMap")["data"]["blockd.yaml"])
    tenants_path = tmp_path / "tenants.yaml"
    tenants_path.write_bytes(tenants
                             or base64.b64decode(one(docs, "Secret")["data"]["tenants.yaml"]))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("BLOCKD_")}
    crt, key = self_signed(tmp_path)
    env.update({
        "BLOCKD_SERVER_TLS_CERT": str(crt), "BLOCKD_SERVER_TLS_KEY": str(key),
        "BLOCKD_SERVER_UNIX_SOCKET": str(tmp_path / "blockd.sock"),
        "BLOCKD_SERVER_HANDLE_SOCKET": str(tmp_path / "blockd-pool.sock"),
        "BLOCKD_SERVER_TCP_ADDRESS": f"127.0.0.1:{port}",
        "BLOCKD_METRICS_ADDRESS": "127.0.0.1:0",
        "BLOCKD_EVENTS_ZMQ_ENDPOINT": "tcp://127.0.0.1:*",
        "BLOCKD_EVENTS_REPLAY_ENDPOINT": "tcp://127.0.0.1:*",
        "BLOCKD_TENANTS_FILE": str(tenants_path),
        "BLOCKD_POOL_NUM_BLOCKS": "64",
        "POD_NAME": "blockd-inference-test", "POD_IP": "127.0.0.1",
    })
    env.update(extra_env or {})
    proc = subprocess.Popen([sys.executable, "-m", "blockd_apps", "serve", "--config", str(config)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=tmp_path)
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("BLOCKD_READY "):
                break
        assert lines and lines[-1].startswith("BLOCKD_READY "), "".join(lines)
        endpoints = json.loads(lines[-1].removeprefix("BLOCKD_READY "))
        # Keep reading its output, so a chatty daemon never blocks on a full pipe.
        threading.Thread(target=proc.stdout.read, daemon=True).start()
        yield Booted(proc, env, config, endpoints)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(20) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_rendered_config_and_tenants_boot_a_real_daemon(rendered: dict[str, Docs],
                                                        tmp_path: Path) -> None:
    """The CPU overlay's ConfigMap and Secret start the daemon, with KV events on, and pass
    the image's health check."""
    with boot(rendered["cpu"], tmp_path) as d:
        assert {"kv_events", "kv_replay"} <= set(d.endpoints)
        health = subprocess.run(
            [sys.executable, str(ROOT / "deploy" / "docker" / "healthcheck.py"),
             "--config", str(d.config)], env=d.env, capture_output=True, text=True, timeout=30,
            check=False)
        assert health.returncode == 0, health.stdout + health.stderr
        # TCP is TLS (the manifests' tls_cert): the check asks the same server on its Unix socket.
        assert f"unix:{d.endpoints['unix']}: SERVING" in health.stdout


def known_worker_token(docs: Docs) -> bytes:
    """The rendered tenants file with the ``worker`` entry's hash replaced by WORKER_TOKEN's
    (the committed hashes are of tokens nobody kept); everything else as rendered."""
    tenants = tenants_yaml(docs)
    workers = [w for w in tenants["workers"] if w["name"] == "worker"]
    assert len(workers) == 1
    workers[0]["token_sha256"] = tenants_file.token_hash(WORKER_TOKEN)
    return yaml.safe_dump(tenants).encode()


def pool_layout(cfg: blockd_config.Config) -> KvLayout:
    return KvLayout(num_layers=cfg.pool.num_layers, num_kv_heads=cfg.pool.num_kv_heads,
                    head_dim=cfg.pool.head_dim, block_size=cfg.pool.block_size,
                    dtype=cfg.pool.dtype)


def lists(obj: Any) -> Iterator[list[Any]]:
    """Every list nested in a decoded msgpack value."""
    if isinstance(obj, (list, tuple)):
        yield list(obj)
        for x in obj:
            yield from lists(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from lists(x)


def test_the_rendered_daemon_publishes_kv_events_under_the_pods_topic(
        rendered: dict[str, Docs], tmp_path: Path) -> None:
    """A real subscriber of the booted daemon's PUB socket gets vLLM-style messages whose
    topic frame is kv@<POD_IP>@<events.model_name>, for a block the worker commits."""
    import msgpack
    import zmq

    docs = rendered["cpu"]
    _, cfg = blockd_yaml(docs, tmp_path)
    ns = rq.namespace("model", model_revision="1")
    with boot(docs, tmp_path / "pod", known_worker_token(docs)) as d, \
            Client(f"unix:{d.endpoints['unix']}", token=WORKER_TOKEN) as client:
        ctx = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(d.endpoints["kv_events"])
        session = client.attach("inference", pool_layout(cfg), worker_name="worker",
                                map_pool=False)
        B = cfg.pool.block_size
        try:
            frames = None
            for i in range(50):  # a fresh block each round until the subscriber has joined
                prompt = [1000 * i + t for t in range(B + 1)]
                out = session.step([rq.admit(prompt, ns)])
                seq = out.results[0].admit.sequence_id
                session.complete(out.fence)
                out = session.step([rq.commit(seq)])
                session.complete(out.fence)
                session.heartbeat()  # reports the fence: the block is indexed and published
                if sub.poll(200):
                    frames = sub.recv_multipart()
                    break
            assert frames is not None, "no KV event reached the subscriber"
            assert frames[0] == cfg.events.resolved_topic(d.env).encode()
            assert len(frames) == 3  # topic, sequence number, payload
            # The shipped tenant is shared, so the unauthenticated stream carries token ids
            # (routers key blocks by them): the committed block's tokens are there.
            assert prompt[:B] in list(lists(msgpack.unpackb(frames[2]))), frames[2]
            session.detach()
        finally:
            sub.close()


def test_the_worker_probes_judge_a_worker_next_to_a_real_daemon(rendered: dict[str, Docs],
                                                                tmp_path: Path) -> None:
    """The worker's probe commands exactly as rendered, in the worker's environment (paths
    moved into tmp_path), against the rendered config: not ready and not live before the
    worker attached; both once it has; a missing token file is not ready but still live; a
    draining and a stopped blockd are not ready, and never fail liveness."""
    docs = rendered["cpu"]
    spec = pod_spec(docs)
    worker = container(spec, "worker", init=False)
    token = tmp_path / "secret" / "token"
    token.parent.mkdir()
    token.write_text(WORKER_TOKEN)
    _, cfg = blockd_yaml(docs, tmp_path)
    layout = pool_layout(cfg)
    with boot(docs, tmp_path / "pod", known_worker_token(docs)) as d:
        env = {k: v for k, v in os.environ.items() if not k.startswith("BLOCKD_")}
        env.update({e["name"]: e["value"] for e in worker["env"] if "value" in e})
        env["BLOCKD_TARGET"] = f"unix:{d.endpoints['unix']}"
        env["BLOCKD_TOKEN_FILE"] = str(token)

        def run(probe: str) -> tuple[int, str]:
            argv = [sys.executable, *worker[probe]["exec"]["command"][1:]]
            p = subprocess.run(argv, env=env, capture_output=True, text=True,
                               timeout=worker[probe]["timeoutSeconds"] + 10, check=False)
            return p.returncode, (p.stdout + p.stderr).strip()

        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            rc, out = run(probe)
            assert rc == 1 and "holds no session" in out, (probe, out)
        client = Client(env["BLOCKD_TARGET"], token_file=env["BLOCKD_TOKEN_FILE"])
        try:
            session = client.attach("inference", layout, worker_name="worker", map_pool=False)
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                rc, out = run(probe)
                assert rc == 0 and "1 session(s) attached" in out, (probe, out)
            token.unlink()  # the projected Secret is gone
            rc, out = run("readinessProbe")
            assert rc == 1 and f"token_file: {token}: cannot read it" in out, out
            assert run("livenessProbe")[0] == 0
            token.write_text(WORKER_TOKEN + "\n")
            d.proc.send_signal(signal.SIGTERM)  # blockd drains; the session holds it open
            deadline = time.monotonic() + 10
            while (out := run("readinessProbe"))[0] == 0:
                assert time.monotonic() < deadline, out
            assert f"{worker_health.SERVICE} is NOT_SERVING" in out[1], out
            assert run("livenessProbe")[0] == 0
            session.detach()
        finally:
            client.close()
        assert d.proc.wait(20) == 0
        rc, out = run("readinessProbe")
        assert rc == 1 and "UNAVAILABLE" in out, out
        rc, out = run("livenessProbe")
        assert rc == 0 and "passing" in out, out
