"""`eagle3 simulate --draft DIR` and `eagle3 diagnose --draft DIR` on a micro run made by its own stages: a draft other
than the run's, in a layout the importer reads, replayed over the run's held-out suites beside the simulate stage's
output and never over it; a configured suite the data stage made no continuation of is refused by name."""

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from eagle3.bench.simulate import replay_of, simulate
from eagle3.cli import main
from eagle3.resolve import load_config
from eagle3.algorithms.eagle3.checkpoint import NativeDraft, save_native_draft
from eagle3.draft.vocab_map import load_vocab_map
from eagle3.errors import UnreadableInput
from eagle3.model.weights import target_embedding
from eagle3.stages.keys import marker
from eagle3.stages.table import output_of
from helpers import CONFIG, TINY, lens_draft, micro_overrides

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = ["data.num_samples=8", "benchmark.num_prompts=2", "benchmark.max_new_tokens=10", "serving.context_length=512"]
FIGURES = ("num_prompts", "completion_tokens", "verify_ct", "correct_drafts", "accept_length", "accept_rate",
           "histogram", "suites", "prompts", "shapes")


def cli(run_dir, target, *command, extra=()):
    overrides = micro_overrides(run_dir, target) + SMALL + list(extra)
    return main([*command, "--config", str(TINY), *[f"--set={o}" for o in overrides]])


@pytest.fixture(scope="module")
def run(micro_target, tmp_path_factory):
    """A run made by its stages by hand: data, vocab, export and simulate marked as the flow marks them. The trained
    draft is the lens draft on the run's own vocabulary, written where the trainer writes its best checkpoint."""
    root = tmp_path_factory.mktemp("simulate-draft")
    run_dir = root / "run"
    for step in (["data", "regenerate"], ["data", "capture"], ["vocab", "build"]):
        assert cli(run_dir, micro_target, *step) == 0
    vocab_map = load_vocab_map(run_dir / "vocab")
    draft = lens_draft({"embed": target_embedding(micro_target), "vocab_map": vocab_map, "path": micro_target})
    save_native_draft(NativeDraft(CONFIG, draft.export_state()), run_dir / "train" / "best", to="native")
    for step in (["export"], ["simulate"]):
        assert cli(run_dir, micro_target, *step) == 0
    return run_dir, micro_target


def stage_files(run_dir, target) -> dict:
    """The simulate stage's output and marker, byte for byte."""
    config = load_config(TINY, micro_overrides(run_dir, target) + SMALL)
    return {path: path.read_bytes() for path in (output_of(config, "simulate"), marker(config, "simulate"))}


def figures(path) -> dict:
    record = json.loads(path.read_text())
    return {key: record[key] for key in FIGURES}


def test_a_speculators_export_and_an_sglang_copy_replay_beside_the_stage(run, capsys, tmp_path):
    run_dir, target = run
    before = stage_files(run_dir, target)
    assert all(not data.startswith(b"in-progress") for data in before.values())  # finished, under its key
    copy = shutil.copytree(run_dir / "export" / "sglang", tmp_path / "their-sglang")
    speculators = tmp_path / "their-speculators"
    assert main(["convert", str(copy), str(speculators), "--to", "speculators", "--target", str(target)]) == 0
    capsys.readouterr()
    own = figures(run_dir / "bench" / "simulated.json")
    assert own["correct_drafts"] > 0  # the lens draft is right on the newline runs: the figures are not trivial

    for draft, layout in ((copy, "sglang"), (speculators, "speculators")):
        assert cli(run_dir, target, "simulate", "--draft", str(draft)) == 0
        out = capsys.readouterr().out
        table = out[out.index("suite: accept length / accept rate"):].splitlines()
        assert "3/1/4 simulated" in table[0] and "3/4/8 simulated" in table[0] and table[1].startswith("heldout")
        record = run_dir / "bench" / "drafts" / draft.name / "simulated.json"
        saved = json.loads(record.read_text())
        assert saved["draft"]["layout_found"] == layout and saved["draft"]["source"] == str(draft.resolve())
        assert figures(record) == own  # the same draft in either layout: the run's own figures, every shape
        assert stage_files(run_dir, target) == before

    assert cli(run_dir, target, "simulate") == 0  # the stage is still finished under its key
    assert "kept, not made again" in capsys.readouterr().out
    assert stage_files(run_dir, target) == before

    assert cli(run_dir, target, "diagnose", "--draft", str(speculators)) == 0
    out = capsys.readouterr().out
    assert f"simulated {own['accept_length']}, served None" in out and "no served figures" in out
    assert "[passed ] d2t encoding (offsets)" in out
    (speculators / "README.md").write_text("another draft now")  # its figures no longer describe these files
    assert cli(run_dir, target, "diagnose", "--draft", str(speculators)) == 2
    assert f"run `eagle3 simulate --draft {speculators}` again" in capsys.readouterr().err


def test_an_unreadable_draft_is_refused_naming_the_file_or_tensor(run, capsys, tmp_path):
    run_dir, target = run
    before = stage_files(run_dir, target)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli(run_dir, target, "simulate", "--draft", str(empty)) == 2
    assert f"{empty / 'config.json'}: missing (a draft checkpoint needs config.json)" in capsys.readouterr().err

    broken = shutil.copytree(run_dir / "export" / "sglang", tmp_path / "no-d2t")
    tensors = load_file(broken / "model.safetensors")
    del tensors["d2t"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    assert cli(run_dir, target, "simulate", "--draft", str(broken)) == 2
    err = capsys.readouterr().err
    assert f"{broken}: not replayed" in err and "d2t" in err and "(fix: " in err
    assert not (run_dir / "bench" / "drafts" / "no-d2t" / "simulated.json").exists()
    assert cli(run_dir, target, "diagnose", "--draft", str(broken)) == 2
    assert "run `eagle3 simulate --draft" in capsys.readouterr().err
    assert stage_files(run_dir, target) == before


def test_a_missing_upstream_is_refused_naming_the_step(run, capsys, tmp_path):
    run_dir, target = run
    fresh = tmp_path / "fresh"
    assert cli(fresh, target, "simulate", "--draft", str(run_dir / "export" / "sglang")) == 2
    assert "eagle3 data capture" in capsys.readouterr().err
    assert not (fresh / "bench").exists()
    assert cli(run_dir, target, "simulate", "--draft", str(run_dir / "export" / "sglang"),
               extra=[f"target.path={tmp_path / 'gone'}"]) == 2
    assert "eagle3 make-tiny-target" in capsys.readouterr().err


def test_a_configured_suite_without_continuations_is_refused(run, capsys, tmp_path):
    """The data stage made held-out continuations only; a config that also names mtbench is refused by name, never
    replayed on the held-out suite alone: by the simulate stage's runner (the flow's and the step's) and by --draft."""
    run_dir, target = run
    copy = shutil.copytree(run_dir, tmp_path / "run")  # a refused stage may mark itself in progress: not the module's
    written = (copy / "bench" / "simulated.json").read_bytes()
    suites = "benchmark.suites=[heldout, {name: mtbench, num_prompts: 1}]"
    config = load_config(TINY, micro_overrides(copy, target) + SMALL + [suites])
    expected = (f"benchmark.suites names mtbench, but {copy / 'data' / 'suites' / 'heldout_greedy.jsonl'} holds no "
                "continuation of it (only of heldout): run `eagle3 data regenerate` with this benchmark.suites")
    with pytest.raises(UnreadableInput) as refused:
        simulate(replay_of(config), copy / "export" / "sglang", copy / "bench" / "simulated.json",
                 log=lambda line: None)
    assert expected in str(refused.value)
    assert cli(copy, target, "simulate", "--draft", str(copy / "export" / "sglang"), extra=[suites]) == 2
    err = capsys.readouterr().err
    assert expected in err and len(err.strip().splitlines()) == 1
    assert cli(copy, target, "simulate", extra=[suites]) == 2  # by hand: refused before or by the runner
    assert "`eagle3 data regenerate`" in capsys.readouterr().err
    assert (copy / "bench" / "simulated.json").read_bytes() == written
    assert not (copy / "bench" / "drafts" / "sglang").exists()
