"""Every shipped configuration starts, the way its image or Pod starts it, and answers health.

The container images' own ``deploy/docker/blockd.yaml`` once bound ``0.0.0.0:50051`` in
plaintext, which the loopback rule refuses (exit 2): the images' ``CMD`` did not start. Here
each configuration blockd ships is started as it would be:

- the image's: the Dockerfiles' ``ENTRYPOINT`` + ``CMD`` on the file the image copies, then
  its ``HEALTHCHECK`` command; and the documented way to serve remote clients (TLS material
  mounted, ``0.0.0.0``), with a certificate this test makes;
- each Kubernetes overlay's ConfigMap and Secret, as mounted (``test_k8s.boot``), with a
  certificate for the ``blockd-tls`` Secret; ``/healthz`` as the kubelet's probes ask it, gRPC
  health on the Unix socket and over TLS on TCP.

Only what cannot exist outside a container is moved, through the daemon's own ``BLOCKD_*``
environment: the socket and state paths (``/run/blockd``, ``/var/lib/blockd``), free ports
instead of fixed ones, a small pool; a CUDA overlay's pool is the host backend where there is no
GPU (its own layout and every other key as shipped).
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from deploy_support import OVERLAYS, POOL_BACKEND, REMOTE
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_k8s import Docs, boot

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "deploy" / "docker"
IMAGE_CONFIG = "/etc/blockd/config/blockd.yaml"
VARIANTS = ("cpu", "cuda")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def certificate(directory: Path) -> tuple[Path, Path]:
    """A throwaway self-signed certificate for 127.0.0.1 (SAN) and its key, as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "blockd-shipped-config-test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .sign(key, hashes.SHA256()))
    directory.mkdir(parents=True, exist_ok=True)
    crt, pem_key = directory / "tls.crt", directory / "tls.key"
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem_key.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                          serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    pem_key.chmod(0o600)
    return crt, pem_key


def instruction(dockerfile: Path, name: str) -> list[str]:
    """The exec-form argv of the final stage's ``name`` (``ENTRYPOINT``, ``CMD``, or the
    ``CMD`` of ``HEALTHCHECK``)."""
    text = dockerfile.read_text().replace("\\\n", " ")
    final = text.split("\nFROM ")[-1]
    pattern = r"^HEALTHCHECK\b.*?\bCMD\s+(\[.*\])" if name == "HEALTHCHECK" \
        else rf"^{name}\s+(\[.*\])"
    found = re.findall(pattern, final, re.MULTILINE)
    assert found, f"{dockerfile.name}: no exec-form {name}"
    return list(json.loads(found[-1]))


def local(argv: list[str], config: Path) -> list[str]:
    """An image's argv on this machine: the venv's commands, the repository's files."""
    bindir = Path(sys.executable).parent
    out = []
    for arg in argv:
        if arg == IMAGE_CONFIG:
            arg = str(config)
        elif arg == "/opt/blockd/healthcheck.py":
            arg = str(DOCKER / "healthcheck.py")
        elif arg.startswith("/opt/blockd/bin/"):
            arg = str(bindir / Path(arg).name)
        elif not os.path.isabs(arg) and (bindir / arg).exists() and not out:
            arg = str(bindir / arg)
        out.append(arg)
    return out


@contextlib.contextmanager
def serving(argv: list[str], env: dict[str, str], cwd: Path) -> Iterator[dict[str, str]]:
    """Run ``argv`` (a daemon) until it prints BLOCKD_READY; its endpoints; SIGTERM after,
    which must end it with status 0."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=cwd)
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("BLOCKD_READY "):
                break
        assert lines and lines[-1].startswith("BLOCKD_READY "), "".join(lines)
        threading.Thread(target=proc.stdout.read, daemon=True).start()
        yield json.loads(lines[-1].removeprefix("BLOCKD_READY "))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(20) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def grpc_health(channel: grpc.Channel) -> int:
    with channel:
        return int(health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=10).status)


def tls_health(address: str, crt: Path) -> int:
    """gRPC health over TCP with TLS, trusting only ``crt``."""
    creds = grpc.ssl_channel_credentials(root_certificates=crt.read_bytes())
    host, _, port = address.rpartition(":")
    target = f"127.0.0.1:{port}" if host in ("0.0.0.0", "::", "[::]") else address
    return grpc_health(grpc.secure_channel(target, creds))


def http_status(address: str, path: str) -> int:
    host, _, port = address.rpartition(":")
    host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=10) as r:
        return int(r.status)


def container_env(tmp_path: Path) -> dict[str, str]:
    """The daemon's environment in the container, with /run/blockd moved into ``tmp_path``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BLOCKD_")}
    run = tmp_path / "run"
    run.mkdir(mode=0o750)
    env.update({"BLOCKD_SERVER_UNIX_SOCKET": str(run / "blockd.sock"),
                "BLOCKD_SERVER_HANDLE_SOCKET": str(run / "blockd-pool.sock"),
                "BLOCKD_SERVER_TCP_ADDRESS": f"127.0.0.1:{free_port()}",
                "BLOCKD_METRICS_ADDRESS": f"0.0.0.0:{free_port()}"})
    return env


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_image_cmd_starts_on_its_own_config_and_its_healthcheck_passes(
        variant: str, tmp_path: Path) -> None:
    """``ENTRYPOINT`` + ``CMD`` of the image on the config it copies, nothing mounted: it
    serves, and the image's ``HEALTHCHECK`` command exits 0 with SERVING."""
    dockerfile = DOCKER / f"Dockerfile.{variant}"
    assert f"COPY deploy/docker/blockd.yaml {IMAGE_CONFIG}" in dockerfile.read_text()
    config = tmp_path / "blockd.yaml"
    config.write_bytes((DOCKER / "blockd.yaml").read_bytes())
    env = container_env(tmp_path)
    argv = local(instruction(dockerfile, "ENTRYPOINT") + instruction(dockerfile, "CMD"), config)
    with serving(argv, env, tmp_path) as endpoints:
        check = subprocess.run(local(instruction(dockerfile, "HEALTHCHECK"), config), env=env,
                               capture_output=True, text=True, timeout=60, check=False)
        assert check.returncode == 0, check.stdout + check.stderr
        assert "SERVING" in check.stdout
        assert http_status(endpoints["metrics"], "/healthz") == 200


def test_the_image_serves_remote_clients_with_mounted_tls(tmp_path: Path) -> None:
    """The documented way to serve gRPC off the container (deploy/docker/blockd.yaml): a
    certificate and key mounted, every interface, TLS. It starts; health answers over TLS on
    TCP, and the HEALTHCHECK (which then asks the Unix socket) passes."""
    dockerfile = DOCKER / "Dockerfile.cpu"
    config = tmp_path / "blockd.yaml"
    config.write_bytes((DOCKER / "blockd.yaml").read_bytes())
    crt, key = certificate(tmp_path / "tls")
    env = container_env(tmp_path)
    env.update({"BLOCKD_SERVER_TCP_ADDRESS": f"0.0.0.0:{free_port()}",
                "BLOCKD_SERVER_TLS_CERT": str(crt), "BLOCKD_SERVER_TLS_KEY": str(key)})
    argv = local(instruction(dockerfile, "ENTRYPOINT") + instruction(dockerfile, "CMD"), config)
    with serving(argv, env, tmp_path) as endpoints:
        assert endpoints["tls"] == "tls"
        assert tls_health(endpoints["tcp"], crt) == health_pb2.HealthCheckResponse.SERVING
        check = subprocess.run(local(instruction(dockerfile, "HEALTHCHECK"), config), env=env,
                               capture_output=True, text=True, timeout=60, check=False)
        assert check.returncode == 0, check.stdout + check.stderr


def test_the_image_refuses_plaintext_off_loopback(tmp_path: Path) -> None:
    """What the old image config did, refused: exit 2 and one line naming the field."""
    config = tmp_path / "blockd.yaml"
    config.write_bytes((DOCKER / "blockd.yaml").read_bytes())
    env = container_env(tmp_path)
    env["BLOCKD_SERVER_TCP_ADDRESS"] = f"0.0.0.0:{free_port()}"
    out = subprocess.run(local(["blockd", "serve", "--config", IMAGE_CONFIG], config), env=env,
                         capture_output=True, text=True, timeout=60, cwd=tmp_path, check=False)
    assert out.returncode == 2 and "server.tcp_address" in out.stderr, out.stdout + out.stderr


#: The remote overlay's ConfigMap needs a Redis Cluster and the Secret's files:
#: tests/deploy/test_remote_overlay.py starts it against a real one.
@pytest.mark.parametrize("name", [n for n in OVERLAYS if n not in REMOTE])
def test_each_overlay_configmap_starts_as_the_pod_starts_it_and_answers_health(
        rendered: dict[str, Docs], name: str, tmp_path: Path) -> None:
    """The overlay's ConfigMap and Secret as mounted, TLS from a certificate this test makes
    (the blockd-tls Secret), its events section as shipped: it starts; the kubelet's /healthz
    is 200, gRPC health answers SERVING on the Unix socket and over TLS on TCP."""
    crt, key = certificate(tmp_path / "tls")
    extra = {"BLOCKD_SERVER_TLS_CERT": str(crt), "BLOCKD_SERVER_TLS_KEY": str(key),
             "BLOCKD_STATE_DIR": str(tmp_path / "state" / "blockd")}
    if POOL_BACKEND[name] == "cuda":
        extra["BLOCKD_POOL_BACKEND"] = "host"  # no GPU here: the layout stays the overlay's
    with boot(rendered[name], tmp_path / "pod", extra_env=extra) as d:
        assert http_status(d.endpoints["metrics"], "/healthz") == 200
        unix = grpc.insecure_channel(f"unix:{d.endpoints['unix']}")
        assert grpc_health(unix) == health_pb2.HealthCheckResponse.SERVING
        assert tls_health(d.endpoints["tcp"], crt) == health_pb2.HealthCheckResponse.SERVING
