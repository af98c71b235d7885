"""The train–serve diagnosis names the cause of a served accept length below the simulated one."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from drafts import write_draft
from eagle3.bench.diagnose import CHECKS, CONTINUATION_LINE, diagnose
from eagle3.data.conversation import prompt_ids
from eagle3.runtime.generators import LocalGenerator
from eagle3.data.conversation import chat_template_hash
from eagle3.runtime.targets import load_tokenizer
from eagle3.contract.problems import ProblemCode
from eagle3.algorithms.eagle3.validate import validate
from eagle3.serve.inprocess import serve_in_thread
from eagle3.serve.reference import create_app
from fixtures_tiny import one_torch_thread
from helpers import TINY

MICRO = dict(hidden_size=64, target_hidden_size=64, head_dim=16, vocab_size=512, draft_vocab_size=64)


@pytest.fixture
def setup(tmp_path, micro_target):
    data = tmp_path / "data"
    data.mkdir()
    manifest = {"kind": "dataset", "target": {"family": "llama", "num_hidden_layers": 4, "hidden_size": 64},
                "capture": {"aux_layers": [0, 1, 2]},
                "chat_template_sha256": chat_template_hash(load_tokenizer(str(micro_target)))}
    (data / "manifest.json").write_text(json.dumps(manifest))
    draft = write_draft(tmp_path / "draft", layout="sglang", release="0.5.13", **MICRO)
    return draft, micro_target, data


def by_name(diagnosis):
    return {check.name: check for check in diagnosis.checks}


def test_a_good_draft_passes_every_check(setup):
    draft, target, data = setup
    result = diagnose(draft, "0.5.13", target, data, simulated=2.0, served=1.98, longest_request=300)
    assert result.failed == [] and all(c.status == "passed" for c in result.checks if c.name != CONTINUATION_LINE)
    assert by_name(result)[CONTINUATION_LINE].status == "unknown"  # no server given
    assert "simulated 2.0, served 1.98" in result.render()


def test_absolute_d2t_is_named(setup):
    draft, target, data = setup
    tensors = load_file(draft / "model.safetensors")
    tensors["d2t"] = tensors["d2t"] + torch.arange(64)
    save_file(tensors, draft / "model.safetensors")
    result = diagnose(draft, "0.5.13", target, data, simulated=2.0, served=1.02, longest_request=300)
    assert [c.name for c in result.failed] == ["d2t encoding (offsets)"]
    assert "d2t-absolute" in by_name(result)["d2t encoding (offsets)"].evidence and result.gap == pytest.approx(0.49)


def test_every_validation_code_is_on_exactly_one_checklist_line():
    lines_of = {code: [name for name, codes in CHECKS.items() if code in codes] for code in ProblemCode}
    assert {code: lines for code, lines in lines_of.items() if len(lines) != 1} == {}


def edit_config(draft, **changes):
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**config, **changes}))


def store_d2t_as_int32(draft):
    tensors = load_file(draft / "model.safetensors")
    tensors["d2t"] = tensors["d2t"].to(torch.int32)
    save_file(tensors, draft / "model.safetensors")


@pytest.mark.parametrize(("fault", "code", "line"), [
    (lambda d: edit_config(d, tie_word_embeddings=True), "config-tie-embeddings", "config.json fields the engine reads"),
    (lambda d: edit_config(d, num_hidden_layers=2), "config-num-layers", "config.json fields the engine reads"),
    (lambda d: edit_config(d, intermediate_size=96), "shape-mismatch", "tensor shapes and dtypes vs config.json"),
    (store_d2t_as_int32, "dtype", "tensor shapes and dtypes vs config.json"),
], ids=["tied-embeddings", "two-layers", "intermediate-size", "int32-d2t"])
def test_a_fault_validate_flags_fails_its_checklist_line(setup, fault, code, line):
    draft, target, data = setup
    fault(draft)
    assert code in {p.code for p in validate(draft, release="0.5.13", target=target).of("error")}
    result = diagnose(draft, "0.5.13", target, data, simulated=2.0, served=1.1, longest_request=300)
    assert [c.name for c in result.failed] == [line] and f"{code}: " in by_name(result)[line].evidence


def test_layers_0_names_under_0_5_11_are_named(setup):
    draft, target, data = setup
    tensors = {name.replace("midlayer.", "layers.0."): t for name, t in load_file(draft / "model.safetensors").items()}
    save_file(tensors, draft / "model.safetensors")
    result = diagnose(draft, "0.5.11", target, data, simulated=2.0, served=1.02, longest_request=300)
    assert "tensors the release would skip" in [c.name for c in result.failed]
    assert diagnose(draft, "0.5.12", target, data, simulated=2.0, served=2.0, longest_request=300).failed == []


def test_other_template_and_short_context_are_named(setup):
    draft, target, data = setup
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["chat_template_sha256"] = "0" * 64
    (data / "manifest.json").write_text(json.dumps(manifest))
    result = diagnose(draft, "0.5.13", target, data, simulated=2.0, served=1.5, longest_request=100_000)
    assert {c.name for c in result.failed} == {"chat template of data vs server", "max_position_embeddings vs prompt lengths"}


def test_missing_inputs_are_unknown(setup):
    draft, target, data = setup
    result = diagnose(draft, None, target, data, simulated=None, served=1.5)
    assert by_name(result)["max_position_embeddings vs prompt lengths"].status == "unknown"


def test_cli_reads_the_bench_results_and_exits_1_on_a_failed_check(setup, tmp_path, capsys):
    from eagle3.cli import main

    draft, target, data = setup
    run = tmp_path / "run"
    (run / "data").mkdir(parents=True)
    (run / "data" / "hidden").symlink_to(data)
    (run / "export").mkdir()
    (run / "export" / "sglang").symlink_to(draft)
    (run / "bench").mkdir()
    (run / "bench" / "simulated.json").write_text(json.dumps({"accept_length": 2.0}))
    (run / "bench" / "served.json").write_text(json.dumps(
        {"accept_length": 1.9, "prompts": [{"prompt_tokens": 20, "completion_tokens": 64}]}))
    sets = [f"run.dir={run}", f"target.path={target}", "target.hidden_size=64", "target.vocab_size=512",
            "vocab.draft_vocab_size=64", "serving.release=0.5.13"]
    args = ["diagnose", "--config", str(TINY), *[f"--set={s}" for s in sets]]
    assert main(args) == 0 and "[passed ] d2t encoding (offsets)" in capsys.readouterr().out
    tensors = load_file(draft / "model.safetensors")
    tensors["d2t"] = tensors["d2t"] + torch.arange(64)
    save_file(tensors, draft / "model.safetensors")
    assert main(args) == 1 and "[failed ] d2t encoding (offsets)" in capsys.readouterr().out


def stored_greedy(target, length: int) -> dict:
    """A held-out greedy record as the data stage writes it, made on `target`."""
    ids = prompt_ids(load_tokenizer(str(target)), [{"role": "user", "content": "How do I read a file?"}], False)
    continuation = LocalGenerator(str(target), 8, 0.0).continue_greedy([ids], length)[0]
    return {"id": "p0", "prompt_ids": ids, "continuation_ids": continuation}


def perturbed(target, tmp_path):
    """The target with noise on its embedding: another target behind the same name, as a bf16 data stage and a
    float32 server are."""
    copy = tmp_path / "perturbed"
    shutil.copytree(target, copy)
    tensors = load_file(copy / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    embed = tensors["model.embed_tokens.weight"]
    tensors["model.embed_tokens.weight"] = embed + 0.5 * embed.std() * torch.randn(embed.shape, generator=generator)
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    return copy


def test_the_server_parting_from_the_replayed_continuation_is_named_with_its_token(setup, tmp_path):
    draft, target, data = setup
    greedy = stored_greedy(target, 24 + 3)
    with one_torch_thread():
        for server_target, status in ((target, "passed"), (perturbed(target, tmp_path), "failed")):
            with serve_in_thread(create_app(server_target)) as (url, _):
                result = diagnose(draft, "0.5.13", target, data, 2.0, 1.1, 300, greedy, url, 24)
            check = by_name(result)[CONTINUATION_LINE]
            assert check.status == status, check.evidence
    assert "part at token" in check.evidence and "target.dtype" in check.evidence
    assert [c.name for c in result.failed] == [CONTINUATION_LINE]
