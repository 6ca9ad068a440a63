"""The layout's rules, checked on the source with ``ast`` (docs/architecture.md, style habit 2).

* no import cycles between modules of blockd, blockd_client, blockd_gpu and blockd_apps
  (imports under ``if TYPE_CHECKING:`` are annotations only and do not count; an import inside a
  function does);
* the libraries never import the applications, and the daemon never imports the client;
* ``blockd.core`` and ``blockd.runtime`` never import grpc; the core imports nothing of the
  daemon above it, nor protobuf, torch or cuda;
* the runtime, the server and the apps use the manager's contract only
  (``blockd.core.contract.KVManager``, which ``BlockManager`` and the partition coordinator both
  implement with the same signatures): no attribute of a manager outside it (the coordinator's
  partition bookkeeping besides), and no private attribute of anything but ``self``/``cls``;
* no module above ~500 lines outside generated code and tests.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Iterator
from pathlib import Path

import pytest

from blockd.core import BlockManager, PoolSpec, TenantPolicy
from blockd.core.contract import KVManager
from blockd.core.coordinator import PartitionCoordinator

REPO = Path(__file__).resolve().parents[1]
#: Import root of each top-level package.
PACKAGES = {
    "blockd": REPO / "blockd",
    "blockd_client": REPO / "clients" / "blockd_client",
    "blockd_vllm": REPO / "clients" / "blockd_vllm",
    "blockd_gpu": REPO / "gpu" / "blockd_gpu",
    "blockd_apps": REPO / "apps" / "blockd_apps",
}
GENERATED = REPO / "blockd" / "api"
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    out = {}
    for pkg, root in PACKAGES.items():
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            parts = [pkg, *rel.parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth, except those under ``if TYPE_CHECKING:``."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if path.name != "__init__.py":
        base = base[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str) -> set[str]:
    """The modules ``module`` imports (absolute names; a ``from pkg import sub`` names
    ``pkg.sub`` when that is a module)."""
    path = MODULES[module]
    out: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
            continue
        target = _resolve(module, path, node)
        for alias in node.names:
            sub = f"{target}.{alias.name}"
            out.add(sub if sub in MODULES else target)
    return out


def _internal_graph() -> dict[str, set[str]]:
    return {m: {d for d in imports_of(m) if d in MODULES and d != m} for m in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _package_edges(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """Imports from a module into a package's ``__init__`` that itself imports the module's
    package: ``pkg/__init__`` re-exporting from its own submodules is not a cycle of the design,
    so edges *to* a package's ``__init__`` from inside that package are ignored."""
    return {(m, d) for m, deps in graph.items() for d in deps
            if MODULES[d].name == "__init__.py" and m.startswith(d + ".")}


def test_no_import_cycles_between_modules() -> None:
    graph = _internal_graph()
    for m, d in _package_edges(graph):
        graph[m].discard(d)
    assert _cycles(graph) == []


def _top(name: str) -> str:
    return name.split(".")[0]


def _importers(prefix: str, forbidden: tuple[str, ...]) -> list[tuple[str, str]]:
    return sorted((m, d) for m in MODULES if m == prefix or m.startswith(prefix + ".")
                  for d in imports_of(m)
                  if any(d == f or d.startswith(f + ".") for f in forbidden))


def test_libraries_never_import_the_apps_and_the_daemon_never_imports_the_client() -> None:
    assert _importers("blockd", ("blockd_client", "blockd_apps")) == []
    assert _importers("blockd_client", ("blockd_apps",)) == []
    assert _importers("blockd_gpu", ("blockd_apps", "blockd_client")) == []
    assert _importers("blockd_vllm", ("blockd_apps",)) == []
    assert _importers("blockd_client", ("blockd_vllm",)) == []


def test_the_vllm_connector_is_a_client_like_any_worker() -> None:
    """blockd_vllm reaches the daemon only through blockd_client and the wire contract, as any
    engine would: the connector gets no private door into the daemon."""
    allowed = ("blockd.api", "blockd.wire")
    used = {d for m in MODULES if _top(m) == "blockd_vllm" for d in imports_of(m)
            if _top(d) == "blockd"}
    assert {d for d in used if not any(d == a or d.startswith(a + ".") for a in allowed)} == set()


def test_the_client_uses_only_the_contract_of_the_daemon_package() -> None:
    allowed = ("blockd.api", "blockd.wire", "blockd.handle_wire", "blockd.cudadrv")
    used = {d for m in MODULES if _top(m) == "blockd_client" for d in imports_of(m)
            if _top(d) == "blockd"}
    assert {d for d in used if not any(d == a or d.startswith(a + ".") for a in allowed)} == set()


def test_core_and_runtime_import_no_grpc() -> None:
    assert _importers("blockd.core", ("grpc", "grpc_health", "grpc_reflection")) == []
    assert _importers("blockd.runtime", ("grpc", "grpc_health", "grpc_reflection")) == []


def test_core_imports_nothing_above_it() -> None:
    above = ("blockd.api", "blockd.server", "blockd.runtime", "blockd.pools", "blockd.config",
             "google.protobuf", "torch", "triton", "cuda", "numpy.typing")
    assert _importers("blockd.core", above) == []


#: What a caller above the core may read of a manager: the members of the one contract.
MANAGER_API = {name for name in vars(KVManager) if not name.startswith("_")}
#: What a caller may read of the partition coordinator besides: its layout, its partitions'
#: shapes and lower tiers, routing by tenant or session, reload checks, each partition's
#: ``TierIO`` and snapshots (never a partition's ``BlockManager``).
COORDINATOR_API = MANAGER_API | {"spec", "layout", "specs", "partition_of_tenant",
                                 "partition_of_session", "state_counts_of", "check_tenants", "dump",
                                 "load", "tiers", "set_tier_io", "set_partition_listener"}
#: Names the runtime, server and apps give a manager, and the coordinator.
MANAGER_NAMES = {"manager", "m"}
COORDINATOR_NAMES = {"partitions", "parts"}


def test_both_managers_implement_the_contract_with_its_signatures() -> None:
    """Every member of ``KVManager`` exists on ``BlockManager`` and ``PartitionCoordinator``,
    methods with exactly the contract's parameters (names, kinds, defaults)."""
    spec = PoolSpec(num_blocks=8, block_size=4)
    policies = [TenantPolicy("t", quota_blocks=8)]
    for impl in (BlockManager(spec, policies), PartitionCoordinator(spec, policies)):
        for name in sorted(MANAGER_API):
            declared = vars(KVManager)[name]
            assert hasattr(impl, name), f"{type(impl).__name__} lacks {name}"
            if isinstance(declared, property):
                continue
            got = inspect.signature(getattr(impl, name))
            want = inspect.signature(declared.__get__(impl))  # bound, like ``got``
            assert [(p.name, p.kind, p.default) for p in got.parameters.values()] == [
                (p.name, p.kind, p.default) for p in want.parameters.values()], (
                f"{type(impl).__name__}.{name}{got} differs from the contract's {want}")


def _name_of(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _violations(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Attribute):
            continue
        owner = _name_of(node.value)
        where = f"{path.relative_to(REPO)}:{node.lineno}"
        if owner in MANAGER_NAMES and node.attr not in MANAGER_API:
            out.append(f"{where}: {owner}.{node.attr} is not the manager's contract")
        if owner in COORDINATOR_NAMES and node.attr not in COORDINATOR_API:
            out.append(f"{where}: {owner}.{node.attr} is not the coordinator's public API")
        if (node.attr.startswith("_") and not node.attr.startswith("__")
                and owner not in ("self", "cls")):
            out.append(f"{where}: {owner}.{node.attr} is private")
    return out


@pytest.mark.parametrize("prefix", ["blockd.runtime", "blockd.server", "blockd_apps"])
def test_callers_above_the_core_use_only_its_public_api(prefix: str) -> None:
    paths = [p for m, p in MODULES.items() if m == prefix or m.startswith(prefix + ".")]
    assert paths, f"no modules under {prefix}"
    assert [v for p in paths for v in _violations(p)] == []


def test_no_module_is_longer_than_about_500_lines() -> None:
    long = {str(p.relative_to(REPO)): n for p in MODULES.values()
            if GENERATED not in p.parents and (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_the_checks_see_a_cycle_and_a_private_read() -> None:
    """The checkers themselves: a two-module cycle is found, and so is a private read."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    probe = REPO / "tests" / "_architecture_probe.py"
    probe.write_text("def f(manager, other, partitions):\n"
                     "    return manager.alloc, other._x, self._ok, partitions.managers, "
                     "manager.admit, partitions.layout\n")
    try:
        found = _violations(probe)
    finally:
        probe.unlink()
    assert len(found) == 3, found
    assert "manager.alloc" in found[0] and "other._x" in found[1]
    assert "partitions.managers" in found[2]
