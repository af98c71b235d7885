"""Library functions below the stages take the config sections they use, not the whole PipelineConfig: the config
is narrowed where a stage starts (eagle3.stages.table's runners, the tasks, the CLI). A function that still takes it
is listed below with what it reads, and the test keeps that list true: a new function that takes the whole config
fails here, and so does one that reads a single section (it takes that section instead)."""

import ast
from pathlib import Path

from test_layering import LAYERS, layer_of, project_modules

# properties and methods of PipelineConfig -> the sections they read
DERIVED = {"stage_dir": ("run",), "heldout_set": ("benchmark", "training"), "replay_shape": ("serving",),
           "model_dump": ("all",), "model_dump_json": ("all",)}
HANDS_ON = "hands it on"  # passes the whole config to another function that takes it

# function -> what it reads of the config: the sections, and HANDS_ON where it passes the config on
TAKES_THE_CONFIG = {
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
    """Every function below the stages' layer with a parameter annotated PipelineConfig -> what it reads of it."""
    below = layer_of("eagle3.stages")
    found = {}
    for module, path in project_modules().items():
        if not module.startswith("eagle3.") or layer_of(module) >= below:
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


def test_the_list_says_what_each_function_reads_and_none_reads_one_section_alone():
    found = whole_config_takers()
    assert {name: found[name] for name in TAKES_THE_CONFIG if found.get(name) != TAKES_THE_CONFIG[name]} == {}
    assert [name for name, read in found.items() if len(read) == 1 and read != (HANDS_ON,) and read != ("all",)] == []
