"""The project's structure, read from the source (imports inside functions included): no cycle between modules or
packages, no module importing one from a layer above its own, the library never importing Prefect, no module over
450 lines, and library functions below the stages taking the config sections they use."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Lowest first. A module may import from its own layer or a lower one; within a layer, no cycle.
LAYERS = (
    ("eagle3.errors", "eagle3.fsutil", "eagle3.progress", "eagle3.shape", "eagle3.plots", "eagle3.procs",
     "eagle3.distributed", "eagle3.http_retry", "eagle3.warm", "eagle3.guard"),
    ("eagle3.records", "eagle3.contract"),  # run records; the serving engine's contract, as data
    ("eagle3.target",),  # a target model's files, read
    ("eagle3.draft",),  # what every kind of draft on disk shares: file names, the verifier, the vocab map
    ("eagle3.validation",),  # a draft from elsewhere: what every kind's import records and refuses with
    ("eagle3.config",),
    ("eagle3.model",),  # what every draft is built from: blocks, the draft tree, the teacher, the target's tensors
    ("eagle3.algorithms",),  # the draft algorithms: one entry each (model, loss, drafting, serving flags)
    ("eagle3.serving",),  # the serving engines: one entry each (command, probe, release), below every user of one
    ("eagle3.runtime",),  # what runs a target: the tiny target, the answer generators, the feature backends
    ("eagle3.resolve",),  # a config resolved against the registries above: what load_config returns
    ("eagle3.data",),  # orchestrates the engines into data sets
    ("eagle3.stream",),  # features streamed from capture workers to the trainers through a Mooncake store
    ("eagle3.bench",),
    ("eagle3.train",),
    ("eagle3.serve",),
    ("eagle3.registry",),
    ("eagle3.runs",),
    ("eagle3.deployment",),
    ("eagle3.export", "eagle3.init_draft", "eagle3.stages", "eagle3.plan", "eagle3.plan_time", "eagle3.plan_serving",
     "eagle3.plan_stream", "eagle3.plan_clock", "eagle3.report"),
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
    """The package (or top-level module) a module lives in: eagle3.algorithms.eagle3.layouts.sglang is in eagle3.draft."""
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


# Library functions below the stages take the config sections they use, not the whole PipelineConfig: the config is
# narrowed where a stage starts (eagle3.stages.table's runners, the tasks, the CLI). A function that still takes it
# is listed below with what it reads, and the test keeps that list true: a new function that takes the whole config
# fails here, and so does one that reads a single section (it takes that section instead).
# properties and methods of PipelineConfig -> the sections they read
DERIVED = {"stage_dir": ("run",), "heldout_set": ("benchmark", "training"), "replay_shape": ("serving",),
           "model_dump": ("all",), "model_dump_json": ("all",)}
HANDS_ON = "hands it on"  # passes the whole config to another function that takes it

# function -> what it reads of the config: the sections, and HANDS_ON where it passes the config on
TAKES_THE_CONFIG = {
    "eagle3.data.regenerate.greedy_length": ("benchmark", HANDS_ON, "training"),
    "eagle3.data.regenerate.regenerate": ("data", HANDS_ON, "production", "run", "target", "training"),
    # the narrowings that compute the greedy length once (it reads every draft the run trains: draft_configs, the
    # contenders): the continuations' (eagle3.data.regenerate.Continuing) and the simulator's (eagle3.bench.simulate.
    # Replay)
    "eagle3.data.regenerate.continuing": ("benchmark", "data", HANDS_ON, "run", "target", "training"),
    "eagle3.bench.simulate.replay_of": ("benchmark", HANDS_ON, "run", "serving", "sweep", "target"),
    # the data stage's samples: they hand the config to eagle3.data.regenerate's functions, which take it whole
    "eagle3.data.importer.import_rows": ("data", HANDS_ON, "production", "run", "target", "training"),
    "eagle3.data.importer.make_samples": ("data", HANDS_ON),
    # configs made from a config and resolved again (eagle3.resolve.derived), so that a drafting shape, a kind or an
    # endpoint the config cannot serve is refused, never served: a converted draft's, a sweep point's, a version's kind
    "eagle3.deployment.imports.config_for": (HANDS_ON,),
    "eagle3.deployment.sweep.with_shape": (HANDS_ON,),
    "eagle3.deployment.production.of_kind": ("draft", HANDS_ON),
    # they serve such derived configs: the sweep one per drafting shape; production one per version (its kind, shape,
    # prompts) on its own endpoint; an import (`eagle3 registry import`) measures and promotes through production
    "eagle3.deployment.sweep.run_sweep": ("benchmark", "data", HANDS_ON, "run", "serving", "sweep", "target"),
    "eagle3.deployment.sweep.choose_serving": (HANDS_ON, "serving", "sweep"),
    "eagle3.deployment.production.Production.__init__": (HANDS_ON, "production"),
    "eagle3.deployment.imports.import_draft": ("data", HANDS_ON, "registry", "run", "serving", "target"),
    "eagle3.deployment.imports.import_as_production": ("benchmark", "data", "gate", HANDS_ON, "run", "serving", "target"),
    # a version records the whole config it was made with
    "eagle3.deployment.promotion.config_fields": ("all",),
    # the regenerate stage's servers for data.nodes: the config it generates with, reaching them (data.servers)
    "eagle3.serve.data_nodes.on_nodes": ("data", HANDS_ON, "serving"),
    # the trainer: each rank builds it from the run's resolved config file, and its parts replay the held-out
    # sequences by greedy_length (eagle3.data.regenerate), which takes the config
    "eagle3.train.trainer.Trainer.__init__": ("data", "draft", HANDS_ON, "run", "target", "training", "vocab"),
    # a launch's narrowing: what a server reads of the config (eagle3.serving.base.LaunchSpec)
    "eagle3.serving.base.launch_spec": ("data", "draft", "export", "run", "serving", "target"),
}


def reads(function: ast.FunctionDef, name: str) -> tuple[str, ...]:
    parents = {child: node for node in ast.walk(function) for child in ast.iter_child_nodes(node)}
    found = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Name) and node.id == name:
            parent = parents.get(node)
            if isinstance(parent, ast.Attribute) and parent.value is node:
                found.update(DERIVED.get(parent.attr, (parent.attr,)))
            else:
                found.add(HANDS_ON)
    return tuple(sorted(found))


def whole_config_takers() -> dict[str, tuple[str, ...]]:
    """Every function below the stages' layer with a parameter annotated PipelineConfig -> what it reads of it (the
    config's own: eagle3.config, and eagle3.resolve, which makes configs from configs, left out)."""
    below = layer_of("eagle3.stages")
    found = {}
    for module, path in project_modules().items():
        if (not module.startswith("eagle3.") or module.startswith(("eagle3.config", "eagle3.resolve"))
                or layer_of(module) >= below):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef):
                        item.qualname = f"{node.name}.{item.name}"
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef):
                continue
            for arg in node.args.args + node.args.kwonlyargs:
                if arg.annotation is not None and "PipelineConfig" in ast.unparse(arg.annotation):
                    found[f"{module}.{getattr(node, 'qualname', node.name)}"] = reads(node, arg.arg)
    return found


def test_no_function_below_the_stages_takes_the_whole_config_unlisted():
    found = whole_config_takers()
    assert {name: found[name] for name in sorted(set(found) - set(TAKES_THE_CONFIG))} == {}
    assert sorted(set(TAKES_THE_CONFIG) - set(found)) == []  # no stale entry


# Issue 63's count of whole-config signatures: lines under eagle3/ outside the stages, the CLI and the config package
# that define a function with PipelineConfig in the line, or declare `config: PipelineConfig`
#   grep -rn "PipelineConfig" eagle3 --include=*.py | grep "def \|config: PipelineConfig" \
#     | grep -v "^eagle3/stages\|^eagle3/cli/\|^eagle3/config/\|^eagle3/resolve.py" | wc -l
# (eagle3/resolve.py is the config's own load-and-resolve step, the config layer's loader above the registries)
# Beside TAKES_THE_CONFIG's functions it counts what returns a config (Production.measurement: a version's serving
# config), a contender's whole config (eagle3.deployment.contenders.Contender), and the plan's top level at the
# stages' layer, which plans every stage of a config and of its contenders: plan_memory, require_fit,
# chosen_recompute (a config with training.recompute decided), plan_time and contender_stages.
# It may only shrink: lower the figure when a change narrows more of them.
WHOLE_CONFIG_LINES_AT_MOST = 25


def whole_config_lines() -> list[str]:
    """The grep's lines, as `path:line: text`."""
    found = []
    for path in sorted((ROOT / "eagle3").rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        if name.startswith(("eagle3/stages", "eagle3/cli/", "eagle3/config/", "eagle3/resolve.py")):
            continue
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if "PipelineConfig" in line and ("def " in line or "config: PipelineConfig" in line):
                found.append(f"{name}:{number}: {line.strip()}")
    return found


def test_whole_config_signatures_do_not_grow_back():
    found = whole_config_lines()
    assert len(found) <= WHOLE_CONFIG_LINES_AT_MOST, "\n".join(found)


def test_the_list_says_what_each_function_reads_and_none_reads_one_section_alone():
    found = whole_config_takers()
    assert {name: found[name] for name in TAKES_THE_CONFIG if found.get(name) != TAKES_THE_CONFIG[name]} == {}
    assert [name for name, read in found.items() if len(read) == 1 and read != (HANDS_ON,) and read != ("all",)] == []


def serving_engine_reads(source: str) -> list[str]:
    """Each place `source` reads a config's serving.engine other than to look up its entry (`serving_engine(...)`)."""
    tree = ast.parse(source)
    looked_up = {id(arg) for node in ast.walk(tree) if isinstance(node, ast.Call)
                 and ast.unparse(node.func).endswith("serving_engine") for arg in node.args}
    return [f"{node.lineno}: {ast.unparse(node)}" for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr == "engine"
            and ast.unparse(node.value).split(".")[-1] == "serving" and id(node) not in looked_up]


def test_only_the_serving_engines_read_serving_engine():
    """An engine's own behaviour lives in its module under eagle3/serving (docs/serving-and-benchmark.md): no
    other module branches on the engine's name, so adding one touches its module and the registry alone. The resolve
    step reads it only to check it against the registry."""
    seam, resolve = ROOT / "eagle3" / "serving", ROOT / "eagle3" / "resolve.py"
    found = [f"{path.relative_to(ROOT)}:{place}" for path in project_modules().values()
             if seam not in path.parents and path != resolve for place in serving_engine_reads(path.read_text())]
    assert found == []


def test_the_serving_engine_rule_finds_a_branch():
    branch = "def f(config):\n    return serving_engine(config.serving.engine) if config.serving.engine == 'x' else 0\n"
    assert serving_engine_reads(branch) == ["2: config.serving.engine"]
