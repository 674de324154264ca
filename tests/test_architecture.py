"""docs/architecture.md stays true: every module it names exists, and the boundary it states holds
(`fp8_trainer` and `monitor_server` never import each other; `fp8_protocol` imports neither, nor torch)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"


def test_every_module_the_doc_names_exists():
    named = set(
        re.findall(
            r"`((?:fp8_trainer|fp8_protocol|monitor_server|kernels|web|tests)/[\w./]+)`", DOC.read_text()
        )
    )
    assert len(named) > 20
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert missing == []


def _imports(package: str) -> dict[str, set[str]]:
    """Top-level packages each module of `package` imports (absolute imports)."""
    out = {}
    for path in (ROOT / package).rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        names = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        out[str(path.relative_to(ROOT))] = names
    return out


def test_the_runtime_and_the_service_never_import_each_other():
    trainer = {p for p, names in _imports("fp8_trainer").items() if "monitor_server" in names}
    service = {p for p, names in _imports("monitor_server").items() if "fp8_trainer" in names}
    assert trainer == set() and service == set()


def test_the_protocol_is_torch_free_and_imports_neither_side():
    bad = {
        p: n & {"torch", "fp8_trainer", "monitor_server", "fp8_kernels"}
        for p, n in _imports("fp8_protocol").items()
    }
    assert {p: n for p, n in bad.items() if n} == {}


def test_no_route_module_imports_another():
    """What routes share lives in `monitor_server/api/deps.py` or a service module, not in a route."""
    routes = {
        p: {n for n in _module_imports(ROOT / p) if n.startswith("monitor_server.api.routes")}
        for p in _imports("monitor_server/api/routes")
    }
    assert {p: n for p, n in routes.items() if n} == {}


def _module_imports(path: Path) -> set[str]:
    """The modules a file imports absolutely, dotted (``from a.b import c`` gives ``a.b`` and ``a.b.c``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return names


def _package_graph(folder: str, package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports, at any depth of the file (a function's
    lazy import is still a dependency), relative (``from .x import``) and absolute (``package.x``)."""
    modules = {p.stem: p for p in (ROOT / folder).glob("*.py") if p.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level == 1 and node.module:
                    deps.add(node.module.split(".")[0])
                elif node.level == 1:
                    deps |= {a.name for a in node.names}
                elif node.level == 0 and node.module and node.module.startswith(package + "."):
                    deps.add(node.module.split(".")[1])
                elif node.level == 0 and node.module == package:
                    deps |= {a.name for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name.split(".")[1] for a in node.names if a.name.startswith(package + ".")}
        graph[name] = (deps & modules.keys()) - {name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (module names, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return path[path.index(m) :] + [m]
            if m not in state and (found := visit(m)):
                return found
        state[n] = 2
        path.pop()
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_the_kernels_form_no_import_circle():
    """``fp8_kernels`` (the ``kernels`` folder): what the dispatch and the Triton launchers both need about
    the device lives in ``device.py``, below both; lazy imports inside functions count."""
    graph = _package_graph("kernels", "fp8_kernels")
    assert {"dispatch", "triton_launch", "device"} <= graph.keys()
    assert _cycle(graph) is None, _cycle(graph)


def test_the_circle_check_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
