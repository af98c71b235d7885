"""The project's import order, read from the source (imports inside functions included): no cycle between modules,
no module importing one from a layer above its own, and the library never importing Prefect."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Lowest first. A module may import from its own layer or a lower one; within a layer, no cycle.
LAYERS = (
    ("eagle3.errors", "eagle3.fsutil", "eagle3.progress", "eagle3.shape", "eagle3.plots", "eagle3.procs",
     "eagle3.distributed", "eagle3.http_retry", "eagle3.warm"),
    ("eagle3.records", "eagle3.contract"),  # run records; the serving engine's contract, as data
    ("eagle3.target",),  # a target model's files, read
    ("eagle3.draft",),  # the draft on disk: layouts, checkpoints, the vocab map
    ("eagle3.validation",),  # a draft checked against the contract
    ("eagle3.config",),
    ("eagle3.model",),
    ("eagle3.engines",),  # what runs a target: the tiny engine, generators, feature backends
    ("eagle3.data",),  # orchestrates the engines into data sets
    ("eagle3.bench",),
    ("eagle3.train",),
    ("eagle3.serve",),
    ("eagle3.registry",),
    ("eagle3.runs",),
    ("eagle3.deployment",),
    ("eagle3.export", "eagle3.init_draft", "eagle3.stages", "eagle3.plan", "eagle3.plan_time", "eagle3.report"),
    ("eagle3.cli",),
    ("tasks",),  # Prefect tasks wrap library calls
    ("flows",),  # flows sequence tasks
)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for top in ("eagle3", "tasks", "flows") for p in (ROOT / top).rglob("*.py")}


def imported_names(path: Path, name: str) -> set[str]:
    """Every absolute module name `path` imports, relative imports resolved, `from m import x` as m.x too."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: {dep for dep in imported_names(path, name) if dep in modules and dep != name}
            for name, path in modules.items()}


def layer_of(module: str) -> int:
    for index, layer in enumerate(LAYERS):
        if any(module == prefix or module.startswith(prefix + ".") for prefix in layer):
            return index
    if module == "eagle3":
        return 0
    raise AssertionError(f"{module} is in no layer: add it to LAYERS in tests/test_layering.py")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in sorted(graph[node]):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle():
    assert cycles(import_graph()) == []


def room(module: str) -> str:
    """The package (or top-level module) a module lives in: eagle3.draft.layouts.sglang is in eagle3.draft."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "eagle3" else parts[0]


def test_no_import_cycle_between_packages():
    rooms = {}
    for module, deps in import_graph().items():
        rooms.setdefault(room(module), set()).update(room(dep) for dep in deps if room(dep) != room(module))
    assert cycles(rooms) == []


def test_no_module_imports_from_a_layer_above_its_own():
    upward = [f"{module} imports {dep}" for module, deps in sorted(import_graph().items()) for dep in sorted(deps)
              if layer_of(dep) > layer_of(module)]
    assert upward == []


def test_the_library_never_imports_prefect():
    library = {name: path for name, path in project_modules().items() if name.startswith("eagle3")}
    offenders = [name for name, path in library.items()
                 if any(dep.split(".")[0] == "prefect" for dep in imported_names(path, name))]
    assert offenders == []


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": set()}, []),
])
def test_the_cycle_finder_finds_cycles(graph, expected):
    assert cycles(graph) == expected


def test_every_module_is_in_a_layer():
    for name in project_modules():
        layer_of(name)


def test_no_module_is_over_450_lines():
    long = {name: n for name, path in project_modules().items() if (n := len(path.read_text().splitlines())) > 450}
    assert long == {}
