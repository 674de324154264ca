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
            r"`((?:fp8_trainer|fp8_protocol|monitor_server|fp8_kernels|web|tests)/[\w./]+)`", DOC.read_text()
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


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """Ids of the nodes inside ``if TYPE_CHECKING:`` blocks (imports for annotations only, never run)."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return inside


def _package_graph(package: str, *, runtime: bool = False) -> dict[str, set[str]]:
    """Module (dotted below ``package``: ``dispatch``, ``triton.launch``; a subfolder's ``__init__`` by the
    folder's name) -> the modules of the same package it imports, at any depth of the file (a function's lazy
    import is still a dependency), relative (``from .x import``, ``from ..x import``) and absolute
    (``package.x``). The package's own ``__init__`` (what its users import) is left out. ``runtime``: without
    the imports under ``if TYPE_CHECKING:``, which annotations need and nothing runs."""
    root = ROOT / package
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if parts:
            modules[".".join(parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        deps = set()
        tree = ast.parse(path.read_text(), str(path))
        skipped = _type_checking_nodes(tree) if runtime else set()
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[: len(here) - (node.level - 1)]
                    mod = base + (node.module.split(".") if node.module else [])
                elif node.module and (node.module + ".").startswith(package + "."):
                    mod = node.module.split(".")[1:]
                else:
                    continue
                for a in node.names:  # ``from . import x``: module x if there is one, else the package
                    sub = ".".join([*mod, a.name])
                    deps.add(sub if sub in modules else ".".join(mod))
            elif isinstance(node, ast.Import):
                deps |= {a.name.split(".", 1)[1] for a in node.names if a.name.startswith(package + ".")}
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
    """``fp8_kernels``, its subfolders included: what the dispatch and the Triton launchers both need about
    the device lives in ``device.py``, below both; lazy imports inside functions count."""
    graph = _package_graph("fp8_kernels")
    assert {"dispatch", "device", "triton.launch", "reference.quantize", "cpu.fused"} <= graph.keys()
    # the graph sees a relative import of the parent folder, and the dispatch's lazy imports
    assert "device" in graph["triton.launch"] and "triton.quantize" in graph["dispatch"]
    assert _cycle(graph) is None, _cycle(graph)


def test_the_kernels_are_layered_below_the_dispatch():
    """The references import no kernel (they are the specification); the Triton and C kernels import the
    references, ``device`` and ``layout`` but never the dispatch, which registers them."""
    graph = _package_graph("fp8_kernels")
    above = {
        m: {d for d in deps if not d.startswith("reference")}
        for m, deps in graph.items()
        if m.startswith("reference")
    }
    assert {m: d for m, d in above.items() if d} == {}
    kernels = {m: deps for m, deps in graph.items() if m.split(".")[0] in ("triton", "cpu")}
    assert {m: d & {"dispatch"} for m, d in kernels.items() if "dispatch" in d} == {}
    assert kernels["triton.quantize"] >= {"triton.launch", "reference.quantize"}


def test_the_kernels_import_neither_side():
    """``fp8_kernels`` is below both: it imports ``fp8_protocol`` (the statistics columns) and torch, never
    the runtime or the service."""
    bad = {p: n & {"fp8_trainer", "monitor_server"} for p, n in _imports("fp8_kernels").items()}
    assert {p: n for p, n in bad.items() if n} == {}
    assert any("fp8_protocol" in n for n in _imports("fp8_kernels").values())  # the check reads the imports


def test_the_circle_check_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


#: the floors of ``monitor_server`` and what each may import besides itself (``docs/architecture.md``): api →
#: services → storage / detectors → core / infra, never upward; ``app.py`` and ``cli.py`` above them all
SERVICE_FLOORS = {
    "api": {"services", "storage", "detectors", "core", "infra"},
    "services": {"storage", "detectors", "core", "infra"},
    "storage": {"core", "infra"},
    "detectors": {"core", "infra"},
    "infra": {"core"},
    "core": set(),
}
SERVICE_TOP = {"app", "cli"}


def _upward(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Module -> the modules it imports from a floor above its own or beside it (none: the rule holds);
    a module on no floor is listed with what it imports (or ``{"(no floor)"}``)."""
    bad = {}
    for module, deps in graph.items():
        floor = module.split(".")[0]
        if module in SERVICE_TOP:
            continue
        if floor not in SERVICE_FLOORS:
            bad[module] = {"(no floor)"}
            continue
        allowed = SERVICE_FLOORS[floor] | {floor}
        if wrong := {d for d in deps if d.split(".")[0] not in allowed}:
            bad[module] = wrong
    return bad


def test_the_service_imports_only_down_its_floors():
    """Routes ask services, services use storage and the detectors, and those stand on core and infra: no
    module imports one on a floor above its own, lazy and type-checking imports included; every module
    but the application (``app.py``, ``cli.py``) sits on a floor, so the flat package does not grow back."""
    graph = _package_graph("monitor_server")
    assert {
        "api.deps",
        "services.ingest",
        "storage.rollups",
        "detectors.engine",
        "core.config",
    } <= graph.keys()
    assert "storage.models" in graph["services.ingest"]  # the graph reads the absolute imports
    assert _upward(graph) == {}
    assert {m for m in graph if "." not in m} == SERVICE_TOP | SERVICE_FLOORS.keys()


def test_the_service_forms_no_import_circle():
    graph = _package_graph("monitor_server")
    assert _cycle(graph) is None, _cycle(graph)


def test_the_floor_check_finds_an_upward_import():
    ok = {
        "api.deps": {"services.ingest", "core.config"},
        "services.ingest": {"storage.models"},
        "app": {"api"},
    }
    assert _upward(ok) == {}
    up = {**ok, "storage.rollups": {"storage.models", "services.ingest"}, "core.db": {"infra.wire"}}
    assert _upward(up) == {"storage.rollups": {"services.ingest"}, "core.db": {"infra.wire"}}
    assert _upward({"detectors.engine": {"storage.models"}}) == {"detectors.engine": {"storage.models"}}
    assert _upward({"rollups": set()}) == {"rollups": {"(no floor)"}}


def test_no_service_module_is_over_600_lines():
    """A module that grows past this is split on its seams (as the statistics rows left the rollups)."""
    sizes = {
        str(p.relative_to(ROOT)): len(p.read_text().splitlines())
        for p in (ROOT / "monitor_server").rglob("*.py")
    }
    assert len(sizes) > 80
    assert {p: n for p, n in sizes.items() if n > 600} == {}


#: what a session runs against the database; a route hands its session to a service instead
SESSION_SQL = {"execute", "scalar", "scalars", "get", "add", "add_all", "flush", "delete", "merge", "query"}


def _sql_in(source: str) -> set[str]:
    """The SQL a module's source runs itself: imports of SQLAlchemy's query builders (anything but
    ``sqlalchemy.orm``'s types and ``sqlalchemy.exc``'s errors) and calls like ``session.execute(...)``."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
        elif isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        else:
            modules = []
        found |= {
            m
            for m in modules
            if m.split(".")[0] == "sqlalchemy" and m not in ("sqlalchemy.orm", "sqlalchemy.exc")
        }
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in SESSION_SQL
        ):
            target = node.func.value
            if isinstance(target, ast.Name) and target.id == "session":
                found.add(f"session.{node.func.attr}")
    return found


def test_routes_run_no_sql():
    """A route validates, calls services with its session (or opens the transaction they run in) and
    answers from Public models; the queries themselves are the services'."""
    routes = {p: _sql_in((ROOT / p).read_text()) for p in _imports("monitor_server/api/routes")}
    assert len(routes) > 10
    assert {p: s for p, s in routes.items() if s} == {}


def test_the_sql_check_finds_sql():
    assert _sql_in("from sqlalchemy import select\nsession.execute(select(A))") == {
        "sqlalchemy",
        "session.execute",
    }
    assert _sql_in("from sqlalchemy.orm import Session\nrows = list_rows(session, run_id=1)") == set()
    assert _sql_in("run = session.get(Run, 1)") == {"session.get"}


def _library_imports_of_the_app(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Module of the library (``fp8_trainer`` outside ``app/``) -> the ``app`` modules it imports."""
    return {
        m: {d for d in deps if d.split(".")[0] == "app"}
        for m, deps in graph.items()
        if m.split(".")[0] != "app" and any(d.split(".")[0] == "app" for d in deps)
    }


def test_the_library_never_imports_the_application():
    """``fp8_trainer`` is the library and ``fp8_trainer/app/`` the ``fp8-train`` application built on it: the
    application imports the library, never the other way round (lazy imports and the package's own
    ``__init__`` included), so the library can be used without the app."""
    graph = _package_graph("fp8_trainer")
    assert {"app.cli", "app.train", "app.build", "linear", "monitor.client"} <= graph.keys()
    assert {"app.train", "app.build"} <= graph["app.cli"] and "convert" in graph["app.train"]
    assert _library_imports_of_the_app(graph) == {}
    init = _module_imports(ROOT / "fp8_trainer" / "__init__.py")
    relative = {  # ``from .app import x`` gives app, ``from . import app`` app too
        (node.module or alias.name).split(".")[0]
        for node in ast.walk(ast.parse((ROOT / "fp8_trainer" / "__init__.py").read_text()))
        if isinstance(node, ast.ImportFrom) and node.level
        for alias in node.names
    }
    assert "recipe" in relative  # the check reads the package's relative imports
    assert not {n for n in init if n.startswith("fp8_trainer.app")} and "app" not in relative


def test_the_application_forms_no_import_circle():
    graph = _package_graph("fp8_trainer")
    app = {m: {d for d in deps if d.startswith("app.")} for m, deps in graph.items() if m.startswith("app.")}
    assert len(app) >= 15
    assert _cycle(app) is None, _cycle(app)


def test_the_library_check_finds_an_import_of_the_app():
    graph = {"linear": {"state"}, "state": set(), "app.train": {"linear"}, "monitor.client": {"app.model"}}
    assert _library_imports_of_the_app(graph) == {"monitor.client": {"app.model"}}


def test_no_package_forms_an_import_circle_when_it_runs():
    """No circle anywhere among the imports that run, lazy ones included (a module's ``if TYPE_CHECKING:``
    imports, for its annotations only, are the one way two modules may name each other)."""
    circles = {pkg: _cycle(_package_graph(pkg, runtime=True)) for pkg in PACKAGES}
    assert circles == dict.fromkeys(PACKAGES)
    # the runtime graph drops exactly the type-checking imports: FP8State is annotated in step.py
    assert "state" in _package_graph("fp8_trainer")["step"]
    assert "state" not in _package_graph("fp8_trainer", runtime=True)["step"]


PACKAGES = ("fp8_protocol", "fp8_kernels", "fp8_trainer", "monitor_server")


#: where the size limits hold: the Python of the product, its benchmarks and scripts (the Triton kernels,
#: whose bodies are one launch each, and the migrations, written once, are left out), and the dashboard
SIZED = ("fp8_protocol", "fp8_kernels", "fp8_trainer", "monitor_server", "bench", "scripts")
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 600, 80


def _oversized() -> list[str]:
    """Modules over ``MAX_MODULE_LINES`` lines and functions over ``MAX_FUNCTION_LINES``, as ``path`` or
    ``path:function (lines)``."""
    found = []
    for folder in SIZED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if "/migrations/" in rel or rel.startswith("fp8_kernels/triton/"):
                continue
            text = path.read_text()
            if len(text.splitlines()) > MAX_MODULE_LINES:
                found.append(rel)
            for node in ast.walk(ast.parse(text, rel)):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        found.append(f"{rel}:{node.name} ({lines})")
    for path in sorted((ROOT / "web" / "js").rglob("*.js")):
        if len(path.read_text().splitlines()) > MAX_MODULE_LINES:
            found.append(path.relative_to(ROOT).as_posix())
    return found


def test_no_module_or_function_outgrows_its_limit():
    """Small modules and functions: none over 600 and 80 lines, outside the Triton kernels and migrations."""
    assert _oversized() == []
    assert sum(1 for folder in SIZED for _ in (ROOT / folder).rglob("*.py")) > 200  # the walk reads the tree
