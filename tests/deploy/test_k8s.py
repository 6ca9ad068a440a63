"""The Kustomize base and overlays: they render, validate offline against the Kubernetes API
schemas, and say what the daemon needs (config, credentials, sockets, probes, hardening)."""

from __future__ import annotations

import argparse
import base64
import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_support import (
    KUSTOMIZATIONS,
    OVERLAYS,
    ROOT,
    by_kind,
    one,
    require_module,
)

from blockd import config as blockd_config
from blockd.runtime import tenants_file
from blockd.server.app import SERVICE_NAME

Docs = list[dict[str, Any]]

#: Custom resources of the Prometheus Operator. kubernetes-validate bundles only the schemas of
#: the core Kubernetes API, so for these it can only print "Couldn't find schema" and pass: they
#: are excluded from it explicitly (below) and validated structurally by this module instead.
CRD_KINDS = {("monitoring.coreos.com/v1", "PodMonitor"),
             ("monitoring.coreos.com/v1", "PrometheusRule")}
EXPECTED_KINDS = {"Deployment", "ConfigMap", "Secret", "PodDisruptionBudget", "PodMonitor",
                  "PrometheusRule"}
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
    assert cfg.pool.backend == ("cuda" if name == "gpu" else "host")
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
    assert cfg.server.tcp_address.startswith("0.0.0.0:"), "kubelet probes dial the Pod IP"
    ports = {p["name"]: p["containerPort"] for p in blockd["ports"]}
    assert ports["grpc"] == grpc_port
    assert ports["metrics"] == int(cfg.metrics.address.rpartition(":")[2])
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert blockd[probe]["grpc"]["port"] == grpc_port, probe
        assert "exec" not in blockd[probe] and "httpGet" not in blockd[probe]
    assert blockd["readinessProbe"]["grpc"]["service"] == SERVICE_NAME
    startup = blockd["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 60
    assert "startupProbe" not in worker
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
    assert "secretKeyRef" in env["BLOCKD_TOKEN"]["valueFrom"]
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
        assert quantity(state["sizeLimit"]) >= pool_bytes + 64 * MI
        mount = mounts(blockd)["blockd-state"]
        assert cfg.state.dir.startswith(mount + "/") and cfg.state.dir != mount
        assert "blockd-state" not in mounts(container(spec, "worker", init=False))
        assert limit >= pool_bytes + 256 * MI
        assert quantity(shm["sizeLimit"]) >= 64 * MI
    else:
        assert cfg.state.dir == ""
        assert quantity(shm["sizeLimit"]) >= 64 * MI
        assert limit >= 512 * MI


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
    assert image.endswith("-cuda" if name == "gpu" else "-cpu"), image
    assert ":" in image.rsplit("/", 1)[-1], "an explicit tag"


def gpu_requests(c: dict[str, Any]) -> int:
    res = c.get("resources", {})
    limits = int(res.get("limits", {}).get("nvidia.com/gpu", 0))
    requests = int(res.get("requests", {}).get("nvidia.com/gpu", limits))
    assert requests == limits, c["name"]
    return limits


def test_gpu_overlay_shares_one_gpu_by_fd(rendered: dict[str, Docs]) -> None:
    spec = pod_spec(rendered["gpu"])
    blockd = container(spec, "blockd", init=True)
    worker = container(spec, "worker", init=False)
    # One GPU per Pod, requested by the pool's owner; two requests would be two different GPUs.
    assert gpu_requests(blockd) == 1
    assert sum(gpu_requests(c) for c in spec["initContainers"] + spec["containers"]) == 1
    env = {e["name"]: e.get("value") for e in worker["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert spec["nodeSelector"]["nvidia.com/gpu.count"] == "1"
    assert one(rendered["gpu"], "Deployment")["spec"]["strategy"]["rollingUpdate"][
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


def test_rendered_config_and_tenants_boot_a_real_daemon(rendered: dict[str, Docs],
                                                        tmp_path: Path) -> None:
    """The CPU overlay's ConfigMap and Secret, as mounted, start the daemon and pass the image's
    health check. Only what cannot exist outside a Pod is overridden, through the daemon's own
    BLOCKD_* environment: socket and tenants paths, loopback ports, a small pool."""
    docs = rendered["cpu"]
    config = tmp_path / "blockd.yaml"
    config.write_text(one(docs, "ConfigMap")["data"]["blockd.yaml"])
    tenants = tmp_path / "tenants.yaml"
    tenants.write_bytes(base64.b64decode(one(docs, "Secret")["data"]["tenants.yaml"]))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("BLOCKD_")}
    env.update({
        "BLOCKD_SERVER_UNIX_SOCKET": str(tmp_path / "blockd.sock"),
        "BLOCKD_SERVER_HANDLE_SOCKET": str(tmp_path / "blockd-pool.sock"),
        "BLOCKD_SERVER_TCP_ADDRESS": f"127.0.0.1:{port}",
        "BLOCKD_METRICS_ADDRESS": "127.0.0.1:0",
        "BLOCKD_TENANTS_FILE": str(tenants),
        "BLOCKD_POOL_NUM_BLOCKS": "64",
    })
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
        health = subprocess.run(
            [sys.executable, str(ROOT / "deploy" / "docker" / "healthcheck.py"),
             "--config", str(config)], env=env, capture_output=True, text=True, timeout=30,
            check=False)
        assert health.returncode == 0, health.stdout + health.stderr
        assert f"127.0.0.1:{port}: SERVING" in health.stdout
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(20) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
