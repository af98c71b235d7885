"""A kind of draft is one folder plus one registry line (docs/algorithms.md, "Adding one"): outside its folder no
module names it, the config's schema knows no kind, and the resolve step (eagle3.resolve) takes a kind's own section,
its default target layers and its config problems from its entry."""

import ast
import re
from pathlib import Path

import pytest
from pydantic import Field

from eagle3.algorithms import ALGORITHMS
from eagle3.config import resolved_config_file
from eagle3.config.base import Section
from eagle3.errors import ConfigError
from eagle3.resolve import contender_configs, derived, load_config, resolved
from algorithm_toy import ToyAlgorithm
from helpers import TINY

ROOT = Path(__file__).resolve().parent.parent
# Outside a kind's folder, the lines that may name it: the registry line and its import, and the serving engines' own
# method tables (a method's counting rules, keyed by the name the engine serves it as).
MAY_NAME = {
    "eagle3/algorithms/__init__.py": ("from eagle3.algorithms.dflash import DFLASH",
                                      "from eagle3.algorithms.dspark import DSPARK", "ALGORITHMS: dict[str, "),
    "eagle3/serving/sglang.py": ("WHOLE_RUN_FROM = {",),
}
# A kind built on another's model may name it in its own folder: DSpark's draft is DFlash's backbone with two heads, as
# SGLang's DSparkDraftModel extends its DFlashDraftModel.
BUILT_ON = {"dflash": ("dspark",)}


def naming_lines(root: Path, kind: str) -> list[str]:
    """Each line of a module under root/eagle3, outside eagle3/algorithms/<kind>/ (and the folders of the kinds built
    on it), that names `kind` (in any case) and is not one that may."""
    own = tuple(f"eagle3/algorithms/{name}/" for name in (kind, *BUILT_ON.get(kind, ())))
    found = []
    for path in sorted((root / "eagle3").rglob("*.py")):
        name = path.relative_to(root).as_posix()
        if name.startswith(own):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if kind in line.lower() and not line.strip().startswith(MAY_NAME.get(name, ())):
                found.append(f"{name}:{number}: {line.strip()}")
    return found


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_outside_its_folder_no_module_names_a_kind_but_the_registry_line_and_the_engines_method_tables(kind):
    assert naming_lines(ROOT, kind) == []


def test_the_naming_rule_finds_a_mention_outside_the_folder_and_allows_the_registry_line(tmp_path):
    (tmp_path / "eagle3" / "algorithms" / "dflash").mkdir(parents=True)
    (tmp_path / "eagle3" / "algorithms" / "dflash" / "model.py").write_text("class DFlashDraft: ...\n")
    (tmp_path / "eagle3" / "algorithms" / "__init__.py").write_text("from eagle3.algorithms.dflash import DFLASH\n")
    (tmp_path / "eagle3" / "plan.py").write_text("x = 1\n# a DFlash draft's block positions\n")
    assert naming_lines(tmp_path, "dflash") == ["eagle3/plan.py:2: # a DFlash draft's block positions"]


# EAGLE-3's own: SGLang's class and tensor names for it, and its training-time test and tree drafting (definitions and
# imports; the config keys training.ttt_steps / ttt_step_decay are every user's words and stay)
EAGLE3_NAMES = ("midlayer", "LlamaForCausalLMEagle3", "Eagle3DeepseekV2ForCausalLM")
EAGLE3_DRAFTING = re.compile(r"(ttt_\w+|TTT\w*|attend_ttt|draft_tree|draft_chain|DraftCache)$")


def eagle3_outside_its_folder(root: Path) -> list[str]:
    """What of EAGLE-3 a module under root/eagle3 outside eagle3/algorithms/eagle3/ and eagle3/serving/ (the engines'
    own method tables) holds: its checkpoint names or SGLang's classes for it in the text, its TTT or tree drafting
    defined or imported."""
    found = []
    for path in sorted((root / "eagle3").rglob("*.py")):
        name = path.relative_to(root).as_posix()
        if name.startswith(("eagle3/algorithms/eagle3/", "eagle3/serving/")):
            continue
        text = path.read_text()
        found += [f"{name}: names {word}" for word in EAGLE3_NAMES if word in text]
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and EAGLE3_DRAFTING.match(node.name):
                found.append(f"{name}:{node.lineno}: defines {node.name}")
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found += [f"{name}:{node.lineno}: imports {alias.name}" for alias in node.names
                          if EAGLE3_DRAFTING.match(alias.name.rsplit(".", 1)[-1])]
    return found


def test_outside_its_folder_no_module_holds_eagle3s_checkpoint_names_classes_ttt_or_tree_drafting():
    assert eagle3_outside_its_folder(ROOT) == []


def test_the_eagle3_rule_finds_a_name_a_definition_and_an_import_outside_the_folder(tmp_path):
    (tmp_path / "eagle3" / "algorithms" / "eagle3").mkdir(parents=True)
    (tmp_path / "eagle3" / "algorithms" / "eagle3" / "ttt.py").write_text("def ttt_loss(): ...\n")
    (tmp_path / "eagle3" / "plan.py").write_text("from x import draft_tree\nNAME = 'midlayer.fc'\n\n\n"
                                                 "class TTTModel: ...\n")
    assert eagle3_outside_its_folder(tmp_path) == ["eagle3/plan.py: names midlayer", "eagle3/plan.py:1: imports draft_tree",
                                                   "eagle3/plan.py:5: defines TTTModel"]


class HeadsSection(Section):
    count: int = Field(gt=0, description="heads the draft trains, one a drafted position")
    width: int = Field(default=2, gt=0)


class Heads(ToyAlgorithm):
    """The toy of docs/algorithms.md with a section of its own (draft.heads), a default capture of its own and a rule
    of what a config must hold: all declared by the entry, none known to the config's schema."""

    name = "heads"
    section_type = HeadsSection

    def default_aux_layers(self, num_layers: int, draft) -> list[int]:
        return [num_layers - 2]  # the last layer SGLang can capture

    def config_problem(self, draft, target, serving, sweep) -> str | None:
        steps = serving.num_steps
        if draft.heads.count < steps:
            return (f"draft.heads.count {draft.heads.count} drafts fewer positions than serving.num_steps "
                    f"{steps}: raise it")
        return None


@pytest.fixture
def heads(monkeypatch):
    """The entry registered: the one line a new kind adds to eagle3.algorithms."""
    monkeypatch.setitem(ALGORITHMS, Heads.name, Heads())


KIND = ["draft.algorithm=heads", "data.aux_layers=null"]


def test_a_registered_kind_has_its_own_section_typed_its_default_layers_and_its_problems(heads):
    config = load_config(TINY, KIND + ["draft.heads.count=4"])
    assert config.draft.heads == HeadsSection(count=4) and config.data.aux_layers == [2]
    assert config.draft.model_dump()["heads"] == {"count": 4, "width": 2}
    with pytest.raises(ConfigError, match=r"draft.algorithm heads needs draft.heads.count: heads the draft trains"):
        load_config(TINY, KIND)
    with pytest.raises(ConfigError, match=r"draft.heads.cuont \(from --set\): unknown field; allowed here: count, width"):
        load_config(TINY, KIND + ["draft.heads.count=4", "draft.heads.cuont=4"])
    with pytest.raises(ConfigError, match=r"draft.heads.count \(from --set\): Input should be greater than 0"):
        load_config(TINY, KIND + ["draft.heads.count=0"])
    with pytest.raises(ConfigError, match=r"tiny-cpu.yaml: draft.heads.count 2 drafts fewer positions than "
                                          r"serving.num_steps 3: raise it"):
        load_config(TINY, KIND + ["draft.heads.count=2"])


def test_a_section_of_no_registered_kind_or_of_another_kind_is_refused(heads):
    with pytest.raises(ConfigError, match=r"draft.medusa \(from --set\): unknown field; allowed here: algorithm, "
                                          r"attention, .*dflash, .*heads, intermediate_size"):
        load_config(TINY, ["draft.medusa.count=2"])
    with pytest.raises(ConfigError, match=r"draft.heads \(from --set\): describes a heads draft, but draft.algorithm is "
                                          "eagle3: set draft.algorithm heads or remove draft.heads"):
        load_config(TINY, ["draft.heads.count=4"])
    assert "heads" not in load_config(TINY, ["draft.heads=null"]).draft.model_dump()  # null: left out, as old records


def test_configs_made_from_a_resolved_one_are_resolved(heads, tmp_path):
    """Its resolved file, a derived config and a contender of the kind each hold the typed section; a derived change
    the kind refuses is refused as at load."""
    config = load_config(TINY, KIND + ["draft.heads.count=4"])
    assert resolved(config.model_dump(), Path("again")) == config
    assert derived(config, {"draft.heads": {"count": 5}}).draft.heads == HeadsSection(count=5)
    with pytest.raises(ConfigError, match="draft.heads.count 1 drafts fewer positions"):
        derived(config, {"draft.heads": {"count": 1}})
    run = load_config(TINY, [f"run.dir={tmp_path}", "contenders={heads: {draft: {algorithm: heads, heads: {count: 3}}}}"])
    contender = contender_configs(run)["heads"]
    assert (contender.draft.heads, contender.data.aux_layers) == (HeadsSection(count=3), run.data.aux_layers)
    path = resolved_config_file(config.model_copy(update={"run": config.run.model_copy(update={"dir": tmp_path})}))
    assert load_config(path).draft.heads == HeadsSection(count=4)
