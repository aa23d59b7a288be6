"""The package's imports point one way: no module reaches itself through its
imports (counting those inside functions and under ``if TYPE_CHECKING:``), and
the client library and the connectors load nothing of the daemon."""

import ast
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "kvd"
# What only the daemon runs. A client or connector importing one of these
# would pull the store, the SSD log or the native io module into every
# inference engine's process.
DAEMON_PACKAGES = (
    "kvd.store",
    "kvd.l1",
    "kvd.l2",
    "kvd.io",
    "kvd.paths",
    "kvd.daemon",
    "kvd.cluster",
    "kvd.config",
    "kvd.tools",
)
# The daemon's layers, top first (docs/architecture.md): a module imports
# from its own layer or those below it, never from one above. The package's
# own face, ``kvd`` (its version), is below them all.
LAYERS = (
    ("kvd.cli", "kvd.__main__", "kvd.tools"),
    ("kvd.daemon",),
    ("kvd.paths", "kvd.cluster"),
    ("kvd.store",),
    ("kvd.l1", "kvd.l2", "kvd.io"),
    ("kvd.config",),
    ("kvd.wire", "kvd.util", "kvd.v1"),
)
# Beside the layers: the engine's side. Of the daemon's layers only the top
# one (the command, the bench, the demo: clients of a daemon) may import it.
ENGINE_SIDE = ("kvd.client", "kvd.connectors")
# kvd.client speaks the wire and nothing else.
# kvd.io._uring is the C extension alone (no daemon code): the client's gets
# through the pool's directory import it once a directory is mapped.
CLIENT_MAY_IMPORT = ("kvd.client", "kvd.wire", "kvd.util", "kvd.v1", "kvd.io._uring")
FRESH_IMPORT_TIMEOUT_S = 60
NATIVE_MODULES = ("kvd.io._uring",)  # built from native/, no .py of their own
LIST_KVD_MODULES = "import sys\nprint('\\n'.join(m for m in sys.modules if m.startswith('kvd')))"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _under(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == package or name.startswith(package + ".") for package in packages)


def _resolve(name: str, modules: Mapping[str, object]) -> str | None:
    """The module an import of ``name`` loads last: itself (a C extension
    too), or the nearest package above it that is a module of kvd
    (``kvd.a.B`` -> ``kvd.a``)."""
    if name in NATIVE_MODULES:
        return name
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path, modules: Mapping[str, object]) -> set[str]:
    return _imports_in(module, path.read_text(), path.name == "__init__.py", modules)


def _imports_in(
    module: str, source: str, is_package: bool, modules: Mapping[str, object]
) -> set[str]:
    """Every kvd module ``module`` imports, wherever the import statement sits."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # ``from kvd.a import b`` loads kvd.a.b when b is a module, else kvd.a.
            names = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                for alias in node.names
            ]
        else:
            continue
        for name in names:
            target = _resolve(name, modules) if name.startswith("kvd") else None
            if target is not None and target != module:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan),
    each given as one path around it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(_path_around(sorted(component), graph))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def _path_around(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle through the component's first module, for the message."""
    members = set(component)
    start = component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & members):
                if nxt == start:
                    return [*paths[node], start]
                if nxt not in paths:
                    paths[nxt] = [*paths[node], nxt]
                    following.append(nxt)
        frontier = following
    return component


def test_the_graph_sees_every_kind_of_import() -> None:
    modules = dict.fromkeys(["kvd", "kvd.a", "kvd.a.b", "kvd.a.c", "kvd.d", "kvd.e", "kvd.f"])
    source = """
from typing import TYPE_CHECKING
import kvd.a.b
from kvd.a import c, NAME
from . import d
if TYPE_CHECKING:
    from kvd.e import Thing
def later():
    from kvd.f.missing import other
"""
    found = _imports_in("kvd.x", source, False, modules)
    assert found == {"kvd.a.b", "kvd.a.c", "kvd.a", "kvd.d", "kvd.e", "kvd.f"}
    assert _graph()["kvd.store.store"], "no imports found in the package"


def test_no_import_cycles() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_catches_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c", "a"]]


def _layer(module: str) -> int | None:
    if module == "kvd":
        return len(LAYERS)
    for rank, packages in enumerate(LAYERS):
        if _under(module, packages):
            return rank
    return None


def test_every_daemon_module_has_a_layer() -> None:
    unplaced = [m for m in _modules() if _layer(m) is None and not _under(m, ENGINE_SIDE)]
    assert not unplaced, f"modules in no layer of LAYERS: {unplaced}"


def test_imports_point_down_the_layers() -> None:
    upward = []
    for module, targets in _graph().items():
        rank = _layer(module)
        if rank is None:
            continue  # the engine side: the next test
        for target in sorted(targets):
            target_rank = _layer(target)
            if target_rank is None and rank != 0:
                upward.append(f"{module} -> {target} (the engine side)")
            elif target_rank is not None and target_rank < rank:
                upward.append(f"{module} -> {target}")
    assert not upward, "imports that point up the layers:\n" + "\n".join(upward)


def test_client_and_connectors_import_no_daemon_module() -> None:
    offenders = []
    for module, targets in _graph().items():
        if _under(module, ("kvd.client",)):
            bad = sorted(t for t in targets if not _under(t, CLIENT_MAY_IMPORT))
        elif _under(module, ("kvd.connectors",)):
            bad = sorted(t for t in targets if _under(t, DAEMON_PACKAGES))
        else:
            continue
        offenders += [f"{module} -> {target}" for target in bad]
    assert not offenders, "client-side modules importing daemon code:\n" + "\n".join(offenders)


def _loaded_by(probe: str) -> list[str]:
    """The kvd modules a fresh interpreter holds after running ``probe``."""
    script = f"{probe}\n{LIST_KVD_MODULES}"
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=FRESH_IMPORT_TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_checking_settings_loads_no_io_layer() -> None:
    # io_faults and pool_members are checked with their grammars only, which
    # live in kvd.config; the eviction_policy choices are a tuple there.
    loaded = _loaded_by(
        "from kvd.config.settings import Config\n"
        "Config(io_faults='write:eio:nth=1', pool_members='static:127.0.0.1:7070')"
    )
    heavy = ("kvd.io.backend", "kvd.io.faults", "kvd.io._uring", "kvd.l1", "kvd.l2", "kvd.paths")
    heavy += ("kvd.store", "kvd.daemon", "kvd.cluster")
    assert not [m for m in loaded if _under(m, heavy)], loaded


def test_importing_the_client_loads_no_daemon_code() -> None:
    # kvd.connectors.vllm imports vllm's base classes in try/except ImportError
    # (and the rest inside functions), so it imports on a machine without vllm.
    loaded = _loaded_by("import kvd.client, kvd.connectors.vllm, kvd.connectors.common")
    assert "kvd.client.clients" in loaded
    daemon = [m for m in loaded if _under(m, DAEMON_PACKAGES) or m == "kvd.io._uring"]
    assert not daemon, f"importing the client loaded daemon modules: {daemon}"


def test_test_modules_import_no_test_module_or_conftest() -> None:
    # What tests share lives in helper modules (tests/support.py, a folder's
    # support.py); importing a test module would collect its tests twice
    # and tie two modules' fixtures together.
    tests = REPO / "tests"
    offenders = []
    for path in sorted(tests.rglob("*.py")):
        module = _module_name(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] if not node.level else [f".{node.module or ''}"]
                names += [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            leaves = {name.rpartition(".")[2] for name in names}
            if any(leaf.startswith("test_") or leaf == "conftest" for leaf in leaves):
                offenders.append(f"{module}: {ast.unparse(node)}")
    assert not offenders, "test modules importing tests or conftest:\n" + "\n".join(offenders)
