"""The command line as a user runs it: exit codes and one-line errors, through `main()` in this process; one real
process shows a bad input never prints a traceback."""

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import write_data_manifest
from eagle3.cli import build_parser, main
from eagle3.draft.vocab_map import build_vocab_map, save_vocab_map
from helpers import ROOT, TINY
from flows import monitor as flow_monitor
from flows import run as flow_run


@pytest.fixture
def eagle3(capsys):
    """`eagle3 ARGS…` in this process: its exit code and what it printed, as a finished subprocess reports them."""
    def run(*args):
        argv = list(map(str, args))
        code = main(argv)
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["eagle3", *argv], code, out, err)
    return run


@pytest.fixture
def vocab_dir(tmp_path):
    counts = torch.zeros(512, dtype=torch.int64)
    counts[:40] = 100  # the lowest ids (bytes, specials) are frequent ...
    counts[200:260:2] = 7  # ... and so are some scattered ones
    vocab_map, stats = build_vocab_map(counts, 64)
    save_vocab_map(vocab_map, tmp_path / "vocab", stats)
    return tmp_path / "vocab"


def test_inspect_answers_every_d2t_question(vocab_dir, eagle3):
    result = eagle3("inspect", vocab_dir)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "encoding: OFFSETS" in out and "i + d2t[i] equals the set of true entries of t2d" in out
    assert "non-zero entries: 24 of 64" in out and "the first 40 entries are 0" in out and "not a bug" in out
    assert "unique values:" in out and "repeats are normal for offsets" in out
    assert "0->0, 1->1" in out and "63->" in out
    assert "t2d agreement: yes" in out
    assert "coverage: 99.00% of 4,210 counted target tokens" in out and "padding ids" in out


def test_inspect_json_and_absolute_ids(vocab_dir, tmp_path, eagle3):
    data = json.loads(eagle3("inspect", vocab_dir, "--json").stdout)
    assert data["vocab"]["analysis"]["encoding"] == "offsets" and data["vocab"]["stats"]["draft_vocab_size"] == 64
    tensors = load_file(vocab_dir / "vocab_map.safetensors")
    torch.save({"d2t": tensors["d2t"] + torch.arange(64), "t2d": tensors["t2d"]}, tmp_path / "abs.pt")
    out = eagle3("inspect", tmp_path / "abs.pt").stdout
    assert "encoding: ABSOLUTE" in out and "d2t itself equals the set of true entries of t2d" in out


def test_inspect_a_checkpoint(sglang_draft, eagle3):
    result = eagle3("inspect", sglang_draft)
    assert result.returncode == 0, result.stderr
    assert "layout: sglang" in result.stdout and "midlayer.self_attn.q_proj.weight" in result.stdout
    assert "encoding: OFFSETS" in result.stdout


def test_convert_then_validate(native_draft, target_dir, tmp_path, eagle3):
    result = eagle3("convert", native_draft, tmp_path / "out", "--to", "sglang", "--release", "0.5.13",
                    "--target", target_dir)
    assert result.returncode == 0, result.stderr
    manifest = write_data_manifest(tmp_path / "data.json", [0, 1, 2])
    ok = eagle3("validate", tmp_path / "out", "--loader", "sglang", "--release", "0.5.13", "--target", target_dir,
                "--data-manifest", manifest, "--context-length", "512")
    assert ok.returncode == 0 and "valid: 0 error(s)" in ok.stdout
    # the old spelling (before "engine" meant only a serving engine) still checks the same loader, and says the new one
    old = eagle3("validate", tmp_path / "out", "--engine", "sglang", "--release", "0.5.13", "--target", target_dir,
                 "--data-manifest", manifest, "--context-length", "512")
    assert "--engine is deprecated and goes in the next release; write --loader sglang" in old.stderr
    assert old.returncode == 0 and old.stdout == ok.stdout


def test_validate_exit_codes_and_unknowns(sglang_draft, tmp_path, eagle3):
    unknowns = eagle3("validate", sglang_draft)
    assert unknowns.returncode == 0 and "UNKNOWN context-length" in unknowns.stdout
    tensors = load_file(sglang_draft / "model.safetensors")
    tensors["d2t"] = tensors["d2t"] + torch.arange(tensors["d2t"].numel())
    save_file(tensors, sglang_draft / "model.safetensors")
    bad = eagle3("validate", sglang_draft, "--release", "0.5.13", "--json")
    assert bad.returncode == 1
    report = json.loads(bad.stdout)
    assert not report["ok"] and [p["code"] for p in report["problems"] if p["severity"] == "error"] == ["d2t-absolute"]


@pytest.mark.parametrize("command", ["validate", "inspect"])
def test_bad_input_is_one_line_naming_the_path(command, tmp_path, eagle3):
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    (tmp_path / "corrupt" / "model.safetensors").write_bytes(b"\x07\x00garbage")
    cases = {"missing": "no such", "noweights": "no weights", "corrupt": "corrupt safetensors"}
    for name, phrase in cases.items():
        result = eagle3(command, tmp_path / name)
        assert result.returncode == 2
        assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
        assert str(tmp_path / name) in result.stderr and phrase in result.stderr


@pytest.mark.parametrize(
    ("change", "phrase"),
    [
        (["a", "list"], "expected a JSON object"),
        ({"eagle_config": [1, 2]}, "eagle_config must be an object"),
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": "012"}}, "must be a list of integers"),
        ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer"),
        ({"eagle3": "yes"}, "'eagle3' record"),
    ],
)
def test_malformed_configs_are_one_line_errors(sglang_draft, change, phrase, eagle3):
    path = sglang_draft / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps(change if isinstance(change, list) else {**config, **change}))
    for command in ("validate", "inspect", "convert"):
        args = [sglang_draft, sglang_draft.parent / "out", "--to", "native"] if command == "convert" else [sglang_draft]
        result = eagle3(command, *args)
        assert result.returncode == 2, (command, result.stderr)
        assert phrase in result.stderr and "Traceback" not in result.stderr


def test_convert_refusal_exits_1_with_the_cause(native_draft, tmp_path, eagle3):
    # the old spelling of --release still works this release, with a line saying so
    result = eagle3("convert", native_draft, tmp_path / "out", "--to", "sglang", "--engine-version", "0.5.11",
                    "--target-family", "qwen3_5")
    assert "--engine-version is deprecated and goes in the next release; write --release 0.5.11" in result.stderr
    assert result.returncode == 1 and "qwen3_5" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_run_hands_its_arguments_to_the_flow_process(monkeypatch, capsys):
    handed = []
    monkeypatch.setattr(os, "execve", lambda path, argv, env: handed.append((path, argv, env["PYTHONPATH"].split(os.pathsep)[0])))
    main(["run", str(TINY), "--set", "training.max_stepz=3", "--mode", "benchmark"])
    assert handed == [(sys.executable, [sys.executable, "-m", "flows.run", str(TINY), "--set", "training.max_stepz=3",
                                        "--mode", "benchmark"], str(ROOT))]  # the checkout's flows, not installed ones
    # what that process does with them: the config refused in one line before Prefect starts a run
    assert flow_run.main([str(TINY), "--set", "training.max_stepz=3"]) == 1
    assert "training.max_stepz (from --set): unknown field" in capsys.readouterr().err


def test_a_bad_input_in_a_real_process_is_one_line_never_a_traceback(tmp_path):
    """The console path end to end: `python -m eagle3.cli`, the exec into the flow's process, its exit status."""
    result = subprocess.run([sys.executable, "-m", "eagle3.cli", "run", str(tmp_path / "missing.yaml")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stderr.strip() == f"eagle3 run: {tmp_path / 'missing.yaml'}: no such config file"


def subcommands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command path of the parser (`registry list`, ...), nested ones included."""
    found = []
    for action in parser._actions:  # argparse lists its subcommands nowhere public
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += [prefix + (name,)] + subcommands(sub, prefix + (name,))
    return found


def test_every_command_answers_help(monkeypatch, capsys):
    """`eagle3 COMMAND --help` prints that command's usage and exits 0, for every command; `run` and `monitor` hand
    --help to the flow's own parser, which answers it before anything starts."""
    handed = []
    monkeypatch.setattr(os, "execve", lambda path, argv, env: handed.append(argv[3:]))
    flow_entries = {"run": flow_run.main, "monitor": flow_monitor.main}
    commands = subcommands(build_parser())
    assert {("run",), ("monitor",), ("registry", "list"), ("data", "capture")} <= set(commands)
    for command in commands:
        with pytest.raises(SystemExit) as exited:
            main([*command, "--help"])
            assert handed[-1] == ["--help"], command  # run / monitor: the flow process gets --help
            flow_entries[command[0]](handed[-1])
        assert exited.value.code == 0, command
        out = capsys.readouterr().out
        assert out.startswith(f"usage: eagle3 {' '.join(command)}"), (command, out[:200])
