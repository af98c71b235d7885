"""A draft SpecForge itself wrote, imported: SpecForge 0.2.0's own code (its wheel, run in a child process with the
transformers it pins: releases.py; the probe: inside/specforge_export.py) builds its `LlamaForCausalLMEagle3` for the
micro target, computes its vocab map, checkpoints it as its trainer does and exports it with its SGLang exporter.
`eagle3 registry import` reads what it wrote, validates it for SGLang 0.5.13 on the micro target, converts and
publishes it; the version serves on the reference server, and every request's counts equal the simulator's."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest
import torch
from safetensors.torch import save_file

from eagle3.algorithms.eagle3 import EAGLE3
from eagle3.bench.simulate import simulate_prompt
from eagle3.resolve import load_config
from eagle3.deployment.imports import import_draft
from eagle3.algorithms.eagle3.checkpoint import load_native
from eagle3.fsutil import sha256_file
from eagle3.algorithms.eagle3.served import draft_as_served
from eagle3.registry.registry import open_registry
from eagle3.serve.inprocess import serve_in_thread
from eagle3.serve.reference import create_app
from eagle3.shape import DraftShape
from fixtures_tiny import one_torch_thread
from helpers import AUX_LAYERS, CONFIG, TINY, lens_draft, micro_overrides

pytestmark = pytest.mark.specforge

SPECFORGE_RELEASE = "0.2.0"  # the newest on PyPI
RELEASE, STEPS, MAX_NEW = "0.5.13", 3, 24


def specforge_draft_config() -> dict:
    """A draft config as SpecForge's are written (a Llama config naming its draft class; the aux ids, SGLang's
    numbering, nested in eagle_config, where its trainer reads them), for the micro target."""
    fields = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "max_position_embeddings", "rms_norm_eps", "rope_theta", "vocab_size", "draft_vocab_size")
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
            "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16", "pad_token_id": 0,
            "rope_scaling": None, "use_cache": True, **{name: getattr(CONFIG, name) for name in fields},
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX_LAYERS}}  # llama: SGLang id k = our layer k


@pytest.fixture(scope="module")
def written(micro, tmp_path_factory, run_specforge):
    """SpecForge's export of the lens draft (tests/test_simulate.py: it drafts by reading the target, so it is right
    often), its vocab map computed by SpecForge from the same token counts as ours."""
    root = tmp_path_factory.mktemp("specforge")
    (root / "draft_config.json").write_text(json.dumps(specforge_draft_config()))
    lens = lens_draft(micro).export_state()  # canonical names, which are SpecForge's parameter names
    save_file({name: t for name, t in lens.items() if name not in ("d2t", "t2d")}, root / "weights.safetensors")
    counts = torch.bincount(torch.tensor(sum(micro["seqs"], [])), minlength=CONFIG.vocab_size)
    counts[256:] = 0  # as the micro fixture counts them
    job = {"draft_config": str(root / "draft_config.json"), "counts": counts.tolist(),
           "weights": str(root / "weights.safetensors"), "work": str(root), "out": str(root / "export")}
    answer = run_specforge(SPECFORGE_RELEASE, "specforge_export", job)
    return SimpleNamespace(root=root, export=root / "export", answer=answer, lens=lens)


def test_specforge_wrote_it_with_its_own_class_and_the_same_vocab_map(written, micro):
    answer = written.answer
    assert answer["version"] == SPECFORGE_RELEASE and answer["transformers"] == "5.8.1"
    assert answer["class"] == "specforge.modeling.draft.llama3_eagle.LlamaForCausalLMEagle3"
    # our canonical names are its parameter names: only the embedding and the vocab buffers were not given
    assert answer["missing"] == ["d2t", "embed_tokens.weight", "t2d"]
    assert answer["d2t"] == micro["vocab_map"].d2t.tolist()  # its offsets are ours: target id = i + d2t[i]
    config = json.loads((written.export / "config.json").read_text())
    assert answer["files"] == ["config.json", "model.safetensors"] and config["dtype"] == "bfloat16"
    assert "torch_dtype" not in config and "eagle3" not in config  # transformers 5 writes dtype; no record of ours


def test_what_it_wrote_is_imported_validated_and_served(written, micro, tmp_path):
    config = load_config(TINY, micro_overrides(tmp_path / "run", micro["path"]) + [
        f"registry.path={tmp_path / 'registry'}", "serving.context_length=512", f"serving.release={RELEASE}"])
    lines = []
    result = import_draft(config, str(written.export), log=lines.append)
    registry = open_registry(config.registry, log=lambda line: None)
    manifest = registry.manifest(result["version"])
    provenance, validation = manifest["provenance"], manifest["validation"]
    assert result["published"] and provenance["layout_found"] == "sglang"
    assert provenance["files"] == {name: sha256_file(written.export / name) for name in written.answer["files"]}
    assert validation["source"]["ok"] and validation["sglang"]["ok"]
    assert [p for p in validation["source"]["problems"] if p["severity"] != "unknown"] == []
    served = registry.fetch(result["version"], "sglang", tmp_path / "fetched")
    stored = load_native(served)
    assert stored.config.aux_layers == AUX_LAYERS and stored.config.torch_dtype == "bfloat16"
    # every tensor as trained (SpecForge's exporter casts to bfloat16), d2t and t2d as ours
    assert all(torch.equal(stored.tensors[name], tensor.to(stored.tensors[name].dtype))
               for name, tensor in written.lens.items())
    served_draft = draft_as_served(served, RELEASE, micro["embed"]).eval()
    correct = 0
    with one_torch_thread(), serve_in_thread(create_app(micro["path"], served, DraftShape(STEPS), RELEASE)) as (url, _):
        for prompt in micro["prompts"]:
            body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}}
            meta = httpx.post(f"{url}/generate", json=body, timeout=120).raise_for_status().json()["meta_info"]
            row = simulate_prompt(EAGLE3, served_draft, micro["model"], AUX_LAYERS, prompt, MAX_NEW, DraftShape(STEPS),
                                  frozenset({micro["eos"]}), RELEASE)
            assert (meta["completion_tokens"], meta["spec_verify_ct"], meta["spec_num_correct_drafts"]) == (
                row.completion_tokens, row.verify_ct, row.correct_drafts)
            correct += meta["spec_num_correct_drafts"]
    assert correct > 0  # its weights draft the target's guesses, and they are accepted
