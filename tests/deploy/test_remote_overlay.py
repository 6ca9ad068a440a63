"""The remote overlay (deploy/k8s/overlays/remote): the CPU overlay plus blockd's remote tier on
an existing Redis Cluster. Its config differs from the CPU overlay's in ``tiers.*`` only; the
password and the cluster secret are files of a projected Secret only blockd mounts, at the paths
the config names; a second NetworkPolicy lets the Pods out to the cluster's Pods on the port of
``tiers.redis_nodes`` and to DNS, nothing else; and the ConfigMap, started as the Pod starts it
against a real 3-master Redis Cluster (tests/remote/redis_support.py) with the Secret's files
laid out as the kubelet projects them, serves health and exports ``blockd_remote_up 1``.

The generic checks (rendering, strict validation, hardening, memory sized for the pool plus the
host tier and the remote queue, the ingress policy) run on it in tests/deploy/test_k8s.py.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from deploy_support import REMOTE, ROOT, by_kind, http_get, one, require_tool
from grpc_health.v1 import health_pb2
from prometheus_client.parser import text_string_to_metric_families
from test_k8s import (
    EGRESS_POLICY,
    INGRESS_POLICY,
    Docs,
    blockd_yaml,
    boot,
    container,
    ingress_policy,
    mounts,
    pod_spec,
)
from test_shipped_configs import certificate, grpc_health, http_status, tls_health

# The real cluster of the remote tier's own tests; appended, so nothing here is shadowed.
sys.path.append(str(ROOT / "tests" / "remote"))
from redis_support import RedisCluster  # noqa: E402

NAME = REMOTE[0]
#: The Secret the operator creates (never rendered from git) and its two keys.
SECRET = "blockd-remote"
KEYS = ("redis-password", "cluster-secret")
#: The Redis Cluster's Pods and kube-dns, as the egress policy's peers name them.
REDIS_PEER = (("app.kubernetes.io/name", "redis-cluster"),
              ("kubernetes.io/metadata.name", "redis"))
DNS_PEER = (("k8s-app", "kube-dns"), ("kubernetes.io/metadata.name", "kube-system"))


def raw_config(docs: Docs) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(one(docs, "ConfigMap")["data"]["blockd.yaml"])
    return data


def test_only_the_tiers_differ_from_the_cpu_overlay(rendered: dict[str, Docs],
                                                    tmp_path: Path) -> None:
    remote, cpu = raw_config(rendered[NAME]), raw_config(rendered["cpu"])
    assert {k: v for k, v in remote.items() if k != "tiers"} == \
        {k: v for k, v in cpu.items() if k != "tiers"}
    _, cfg = blockd_yaml(rendered[NAME], tmp_path)
    tiers = cfg.tiers
    assert tiers.remote and tiers.host_bytes >= 1 << 30  # fetched prefixes land in a host tier
    assert cfg.state.dir, "the host tier is a file in state.dir: it survives a blockd restart"
    # A real-looking cluster Service (not a placeholder the daemon would refuse), one port.
    hosts = tiers.redis_addresses()
    assert [h for h, _ in hosts] == ["redis-cluster.redis.svc.cluster.local"]
    assert tiers.redis_password_file and tiers.cluster_secret_file
    assert not tiers.redis_tls_ca_file or tiers.redis_tls
    # The Deployment differs from the CPU overlay's only in blockd's memory, its state volume
    # and the Secret's volume and mount.
    spec, cpu_spec = pod_spec(rendered[NAME]), pod_spec(rendered["cpu"])
    assert container(spec, "worker", init=False) == container(cpu_spec, "worker", init=False)
    volumes = {v["name"] for v in spec["volumes"]}
    assert volumes - {v["name"] for v in cpu_spec["volumes"]} == {"blockd-remote"}


def test_the_credentials_are_files_of_a_projected_secret_only_blockd_mounts(
        rendered: dict[str, Docs], tmp_path: Path) -> None:
    docs = rendered[NAME]
    _, cfg = blockd_yaml(docs, tmp_path)
    spec = pod_spec(docs)
    blockd = container(spec, "blockd", init=True)
    files = {"redis-password": cfg.tiers.redis_password_file,
             "cluster-secret": cfg.tiers.cluster_secret_file}
    dirs = {str(Path(f).parent) for f in files.values()}
    assert len(dirs) == 1
    mount = [m for m in blockd["volumeMounts"] if m["mountPath"] in dirs]
    assert len(mount) == 1 and mount[0].get("readOnly") is True, mount
    # A subPath mount is never updated by the kubelet: a rotated Secret would not arrive.
    assert "subPath" not in mount[0] and "subPathExpr" not in mount[0]
    volume = {v["name"]: v for v in spec["volumes"]}[mount[0]["name"]]
    items = {key: Path(path).name for key, path in files.items()}
    assert volume["projected"]["sources"] == [{"secret": {
        "name": SECRET, "items": [{"key": k, "path": items[k]} for k in KEYS]}}]
    mode = volume["projected"]["defaultMode"]
    # Read by blockd's group (fsGroup 10001), writable by nobody, not world-readable.
    assert mode & 0o040 and not mode & 0o227, oct(mode)
    assert volume["name"] not in mounts(container(spec, "worker", init=False))
    assert ("Secret", SECRET) not in {(d["kind"], d["metadata"]["name"]) for d in docs}
    for c in spec["initContainers"] + spec["containers"]:
        for e in c.get("env", []):
            assert "secretKeyRef" not in e.get("valueFrom", {}), (c["name"], e["name"])


def peer_labels(peer: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """A ``to`` entry as its label requirements (namespace AND pod); anything broader refused."""
    assert set(peer) == {"namespaceSelector", "podSelector"}, f"peer {peer}: ipBlock or broader"
    out: list[tuple[str, str]] = []
    for key in ("namespaceSelector", "podSelector"):
        sel = peer[key]
        assert set(sel) == {"matchLabels"} and sel["matchLabels"], f"{key} {sel}: empty"
        out += sel["matchLabels"].items()
    return tuple(sorted(out))


def egress_table(np: dict[str, Any], docs: Docs) -> dict[tuple[int, str], set[Any]]:
    """(port, protocol) -> the peers the policy lets the Pods reach there."""
    spec = np["spec"]
    pod = one(docs, "Deployment")["spec"]["template"]
    assert spec["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items(), \
        "selects no inference Pod"
    assert spec["policyTypes"] == ["Egress"] and "ingress" not in spec
    table: dict[tuple[int, str], set[Any]] = {}
    for i, rule in enumerate(spec["egress"]):
        assert rule.get("to"), f"egress[{i}] allows every destination"
        assert rule.get("ports"), f"egress[{i}] allows every port"
        for port in rule["ports"]:
            assert isinstance(port["port"], int), f"egress[{i}]: a named port"
            assert "endPort" not in port
            for peer in rule["to"]:
                table.setdefault((port["port"], port["protocol"]), set()).add(peer_labels(peer))
    return table


def test_the_egress_policy_opens_only_the_redis_cluster_and_dns(rendered: dict[str, Docs],
                                                                tmp_path: Path) -> None:
    docs = rendered[NAME]
    _, cfg = blockd_yaml(docs, tmp_path)
    policies = {d["metadata"]["name"]: d for d in by_kind(docs, "NetworkPolicy")}
    assert set(policies) == {INGRESS_POLICY, EGRESS_POLICY}
    assert ingress_policy(docs)["spec"]["policyTypes"] == ["Ingress"]  # unchanged (test_k8s)
    ports = {p for _, p in cfg.tiers.redis_addresses()}
    assert ports == {6379}
    assert egress_table(policies[EGRESS_POLICY], docs) == {
        (6379, "TCP"): {REDIS_PEER}, (53, "UDP"): {DNS_PEER}, (53, "TCP"): {DNS_PEER}}
    # The Service the config names is in the namespace whose Pods the policy lets blockd reach.
    (host, _), = cfg.tiers.redis_addresses()
    service, namespace = host.split(".")[:2]
    assert dict(REDIS_PEER)["kubernetes.io/metadata.name"] == namespace
    assert dict(REDIS_PEER)["app.kubernetes.io/name"] == service


def test_the_egress_checks_catch_mistakes(rendered: dict[str, Docs]) -> None:
    docs = rendered[NAME]
    original = {d["metadata"]["name"]: d for d in by_kind(docs, "NetworkPolicy")}[EGRESS_POLICY]
    cases = {
        "every destination": lambda s: s["egress"][0].pop("to"),
        "every port": lambda s: s["egress"][1].pop("ports"),
        "empty": lambda s: s["egress"][0]["to"][0].update(podSelector={}),
        "ipBlock or broader": lambda s: s["egress"][0]["to"].append(
            {"ipBlock": {"cidr": "0.0.0.0/0"}}),
        "a named port": lambda s: s["egress"][0]["ports"].append({"port": "redis",
                                                                   "protocol": "TCP"}),
    }
    for why, change in cases.items():
        np = yaml.safe_load(yaml.safe_dump(original))
        change(np["spec"])
        with pytest.raises(AssertionError, match=why):
            egress_table(np, docs)


def project(directory: Path, files: dict[str, bytes]) -> None:
    """The Secret's files as the kubelet projects them: a timestamped directory, the ``..data``
    symlink to it, and one symlink per item through ``..data``."""
    stamp = directory / "..2026_01_01_00_00_00.000000001"
    stamp.mkdir(parents=True)
    for name, data in files.items():
        (stamp / name).write_bytes(data)
        (stamp / name).chmod(0o440)
        (directory / name).symlink_to(Path("..data") / name)
    (directory / "..data").symlink_to(stamp.name)


def scrape(address: str) -> dict[str, float]:
    host, _, port = address.rpartition(":")
    text = http_get(f"http://{host}:{port}/metrics").decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def test_the_configmap_starts_as_the_pod_starts_it_against_a_real_redis_cluster(
        rendered: dict[str, Docs], tmp_path: Path) -> None:
    """The overlay's ConfigMap and Secret as mounted; the blockd-remote Secret's files where the
    config names them, as the kubelet projects them (moved into tmp_path, same file names);
    the cluster's address instead of the Service's; a small host tier as the pool is small.
    It starts, /healthz is 200, gRPC health SERVING on the Unix socket and over TLS, and the
    remote tier is up: blockd_remote_up 1, no authentication error."""
    require_tool("redis-server", "apt-get install redis-server; .ci/run does it in CI")
    require_tool("redis-cli", "apt-get install redis-server; .ci/run does it in CI")
    docs = rendered[NAME]
    _, cfg = blockd_yaml(docs, tmp_path)
    password = "pw-blockd-remote-overlay"
    secret_dir = tmp_path / "etc-blockd-remote"
    project(secret_dir, {"redis-password": password.encode() + b"\n",
                         "cluster-secret": b"c" * 48 + b"\n"})
    files = {key: secret_dir / Path(path).name
             for key, path in (("PASSWORD", cfg.tiers.redis_password_file),
                               ("SECRET", cfg.tiers.cluster_secret_file))}
    assert all(f.is_symlink() and f.exists() for f in files.values()), files
    crt, key = certificate(tmp_path / "tls")
    with RedisCluster.start(tmp_path / "redis", password=password) as cluster:
        extra = {"BLOCKD_SERVER_TLS_CERT": str(crt), "BLOCKD_SERVER_TLS_KEY": str(key),
                 "BLOCKD_STATE_DIR": str(tmp_path / "state" / "blockd"),
                 "BLOCKD_TIERS_HOST_BYTES": str(16 << 20),
                 "BLOCKD_TIERS_REDIS_NODES": cluster.nodes,
                 "BLOCKD_TIERS_REDIS_PASSWORD_FILE": str(files["PASSWORD"]),
                 "BLOCKD_TIERS_CLUSTER_SECRET_FILE": str(files["SECRET"])}
        with boot(docs, tmp_path / "pod", extra_env=extra) as d:
            assert http_status(d.endpoints["metrics"], "/healthz") == 200
            unix = grpc.insecure_channel(f"unix:{d.endpoints['unix']}")
            assert grpc_health(unix) == health_pb2.HealthCheckResponse.SERVING
            assert tls_health(d.endpoints["tcp"], crt) == health_pb2.HealthCheckResponse.SERVING
            deadline = time.monotonic() + 30
            while (m := scrape(d.endpoints["metrics"]))["blockd_remote_up"] != 1:
                assert time.monotonic() < deadline, {k: v for k, v in m.items()
                                                     if k.startswith("blockd_remote_")}
                time.sleep(0.1)
            assert m['blockd_remote_errors_total{kind="auth"}'] == 0
            assert m["blockd_remote_connects_total"] >= 1
