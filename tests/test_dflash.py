"""DFlash drafts (docs/algorithms.md, "DFlash"): the config, the block model's masks (training's many blocks at once
equal drafting's one at a time, and no block sees past its anchor), the loss rows' alignment, and the real trainer
training, resuming and replaying a DFlash draft on the micro data set."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.algorithms import algorithm, draft_algorithm
from eagle3.algorithms.base import ExportTarget
from eagle3.bench.counting import SpecRequest, correct_drafts_of
from eagle3.algorithms.dflash.blocks import BlockDrafter, BlockRows, anchors_of, block_outputs
from eagle3.algorithms.dflash.model import DFlashConfig, DFlashDraft
from eagle3.bench.simulate import heldout_samples, replay_stored, simulate_prompt
from eagle3.algorithms.dflash.contract import dflash_default_layer_ids
from eagle3.data.regenerate import greedy_length
from eagle3.resolve import load_config
from eagle3.errors import ConfigError, Eagle3Error
from eagle3.model.blocks import init_weights
from eagle3.model.blocks import LossRows
from eagle3.shape import DraftShape
from eagle3.train.trainer import Trainer
from eagle3.serve.reference import create_app
from eagle3.serving.base import launch_spec
from family_targets import DFLASH_CONFIG
from helpers import (MAX_NEW, RELEASE, TINY, block_export, generate, metrics, prompt_of, requests, rewritten, run_copy,
                     serving)

pytestmark = pytest.mark.usefixtures("one_thread")
QUIET = lambda line: None  # noqa: E731
PAD = 5  # the tiny tokenizers' <|pad|>: never generated
DFLASH = ["draft.algorithm=dflash", "draft.dflash.block_size=4", f"draft.dflash.mask_token_id={PAD}",
          "sweep.points=[[1, 1, 2], [2, 1, 3]]"]  # DFlash's shapes: smaller blocks


def tiny_dflash(layers=2, block=4, vocab=40, hidden=32, aux=3, seed=0, rope_theta=10000.0) -> DFlashDraft:
    cfg = DFlashConfig(hidden_size=hidden, target_hidden_size=hidden, intermediate_size=64, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, rms_norm_eps=1e-6,
                       rope_theta=rope_theta, max_position_embeddings=256, vocab_size=vocab, draft_vocab_size=16,
                       torch_dtype="float32", aux_layers=list(range(aux)), target_num_hidden_layers=aux + 2,
                       target_family="llama", block_size=block, mask_token_id=vocab - 1)
    generator = torch.Generator().manual_seed(seed)
    model = DFlashDraft(cfg, torch.randn(vocab, hidden, generator=generator),
                        torch.randn(vocab, hidden, generator=generator))
    init_weights(model, seed)
    with torch.no_grad():  # norms away from 1, so a norm applied in the wrong place shows
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.add_(0.3 * torch.randn(param.shape, generator=generator))
    return model.eval()


# ---- config ------------------------------------------------------------------------------------------------------


def test_a_dflash_config_needs_its_mask_token_and_a_chain_of_its_block():
    with pytest.raises(ConfigError, match="draft.algorithm dflash needs draft.dflash.mask_token_id"):
        load_config(TINY, ["draft.algorithm=dflash"])
    with pytest.raises(ConfigError, match=r"mask_token_id 4096 is outside the target's vocabulary \(0 .. 2047\)"):
        load_config(TINY, DFLASH[:2] + ["draft.dflash.mask_token_id=4096"])
    with pytest.raises(ConfigError, match=r"dflash, sweep.points\[1\]: a DFlash draft proposes one chain a step, not "
                                          r"the tree of steps 3, topk 4, draft tokens 8: eagle_topk must be 1; give "
                                          r"chains \(eagle_topk 1\) of up to 15 steps \(draft.dflash.block_size 16\)"):
        load_config(TINY, ["draft.algorithm=dflash", f"draft.dflash.mask_token_id={PAD}"])
    with pytest.raises(ConfigError, match=r"dflash, serving: steps 4, topk 1, draft tokens 5 verifies blocks of 5 "
                                          r"tokens \(--speculative-num-draft-tokens\), but the draft was trained on "
                                          "blocks of 4 .*num_steps must be at most 3"):
        load_config(TINY, DFLASH + ["serving.num_steps=4"])
    with pytest.raises(ConfigError, match="Qwen3-style layers: draft.attention mha, and none of draft.fc_norm"):
        load_config(TINY, DFLASH + ["draft.fc_norm=true"])
    with pytest.raises(ConfigError, match=r"draft.dflash \(from --set\): describes a dflash draft, but draft.algorithm is "
                                          "eagle3: set draft.algorithm dflash or remove draft.dflash"):
        load_config(TINY, ["draft.dflash.mask_token_id=5"])
    with pytest.raises(ConfigError, match=r"serving.release 0.5.12: SGLang 0.5.12 rotates every DFlash draft with RoPE "
                                          r"base 1,000,000 .* not the trained 10,000: serve with SGLang >= 0.5.13"):
        load_config(TINY, DFLASH + ["serving.release=0.5.12"])
    load_config(TINY, DFLASH + ["serving.release=0.5.12", "draft.rope_theta=1000000"])
    with pytest.raises(ConfigError, match="target.family qwen2: SGLang's qwen2 model has no "
                                          "set_dflash_layers_to_capture in any release"):
        load_config(TINY, DFLASH + ["target.family=qwen2"])
    config = load_config(TINY, DFLASH)
    assert algorithm("dflash").predictions(config.draft, config.training) == 3


def test_the_shipped_dflash_config_serves_chains_no_longer_than_its_block():
    """configs/tiny-dflash-cpu.yaml (`eagle3 run` promotes it: docs/algorithms.md, "DFlash"): the tiny default with a
    two-layer DFlash draft; its serving shape and sweep points are chains in blocks of at most 4."""
    config = load_config(DFLASH_CONFIG)
    assert (config.draft.algorithm, config.draft.dflash.num_layers, config.draft.dflash.block_size) == ("dflash", 2, 4)
    assert config.serving.shape == DraftShape(3) and config.sweep.points == [(1, 1, 2), (2, 1, 3)]
    assert config.registry.path != load_config(TINY).registry.path  # never the EAGLE-3 default's production


def test_without_ids_a_dflash_draft_reads_one_target_layer_per_draft_layer_spread_as_sglang_spreads_them():
    """SGLang's build_target_layer_ids (dflash_utils.py): Kimi-K2.5's 61 layers and a 5-layer draft, Qwen3-8B's 36
    and 5, a one-layer draft (the middle one). tests/conformance/test_dflash.py asks each release's own function."""
    assert dflash_default_layer_ids(61, 5) == [1, 15, 30, 44, 58]
    assert dflash_default_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert dflash_default_layer_ids(36, 1) == [18]
    with pytest.raises(ValueError, match="at least 4 layers, not 3"):
        dflash_default_layer_ids(3, 2)
    config = load_config(TINY, DFLASH + ["data.aux_layers=null", "target.num_hidden_layers=8",
                                         "draft.dflash.num_layers=3"])
    assert config.data.aux_layers == [1, 3, 5]


# ---- the model -------------------------------------------------------------------------------------------------


def test_many_blocks_trained_together_equal_each_block_drafted_alone():
    """Training's flat sequence of blocks over one context (one mask) computes what drafting computes for each block
    over the context before its anchor: the mask is the serving engine's attention."""
    torch.manual_seed(0)
    model = tiny_dflash()
    aux, ids = torch.randn(1, 20, 96), torch.randint(0, 39, (1, 20))
    anchors = torch.tensor([[1, 5, 6, 13, 18]])
    together = model.blocks(model.context(aux), ids.gather(1, anchors), anchors)[0]  # [N, Bk, H]
    context = model.context(aux)
    for n, a in enumerate(anchors[0].tolist()):
        prefix = [(k[:, :, :a], v[:, :, :a]) for k, v in context]
        alone = model.blocks(prefix, ids[:, a : a + 1], torch.tensor([[a]]))[0, 0]
        torch.testing.assert_close(together[n], alone, rtol=1e-5, atol=1e-5)


def test_a_block_sees_nothing_at_or_past_its_anchor_but_its_own_token():
    """Features at positions >= a and tokens after x_a change no output of the block anchored at a (the served
    draft has neither); x_a and the features before a do."""
    torch.manual_seed(1)
    model = tiny_dflash()
    aux, ids, anchors = torch.randn(1, 16, 96), torch.randint(0, 39, (1, 16)), torch.tensor([[7]])
    base = block_outputs(model, aux, ids, anchors)
    later_aux, later_ids = aux.clone(), ids.clone()
    later_aux[:, 7:] += 5.0
    later_ids[:, 8:] = (later_ids[:, 8:] + 1) % 39
    torch.testing.assert_close(block_outputs(model, later_aux, later_ids, anchors), base)
    earlier_aux, own = aux.clone(), ids.clone()
    earlier_aux[:, 6] += 5.0
    own[:, 7] = (own[:, 7] + 1) % 39
    assert not torch.allclose(block_outputs(model, earlier_aux, ids, anchors), base)
    assert not torch.allclose(block_outputs(model, aux, own, anchors), base)


def test_the_export_holds_sglangs_tensor_names_and_not_the_targets():
    model = tiny_dflash(layers=2)
    names = set(model.export_state())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.q_norm.weight",
            "layers.1.self_attn.k_norm.weight", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.gate_proj.weight",
            "layers.0.input_layernorm.weight", "layers.0.post_attention_layernorm.weight"} <= names
    assert not {name for name in names if name.startswith(("embed_tokens", "lm_head", "loss_ids"))}
    clone = tiny_dflash(layers=2, seed=3)
    clone.load_draft_state(model.export_state())
    aux, ids, anchors = torch.randn(1, 10, 96), torch.randint(0, 39, (1, 10)), torch.tensor([[4]])
    clone.lm_head.copy_(model.lm_head)
    clone.embed_tokens.weight.data.copy_(model.embed_tokens.weight)
    torch.testing.assert_close(block_outputs(clone, aux, ids, anchors), block_outputs(model, aux, ids, anchors))


def test_the_drafter_drafts_its_blocks_greedy_tokens_over_the_targets_whole_head():
    """A block of the served num_draft_tokens after x_P over the context before P; the context made a piece at a time
    as the prefix grows equals the one made at once; a block longer than the trained one is refused."""
    torch.manual_seed(2)
    model = tiny_dflash()
    aux, ids = torch.randn(12, 96), torch.randint(0, 39, (12,))
    drafter = BlockDrafter(model, DraftShape(3))
    drafter(aux[:4], ids[:5])  # an earlier verify step: the context of positions 0..3 made then
    tree = drafter(aux[:6], ids[:7])
    hidden = model.blocks(model.context(aux[None, :6]), ids[6].view(1, 1), torch.tensor([[6]]))[0, 0, 1:]
    assert tree.tokens == (hidden @ model.lm_head.T).argmax(-1).tolist() and tree.parents == [-1, 0, 1]
    smaller = model.blocks(model.context(aux[None, :6]), ids[6].view(1, 1), torch.tensor([[6]]), size=3)[0, 0, 1:]
    assert BlockDrafter(model, DraftShape(2))(aux[:6], ids[:7]).tokens == model.greedy(smaller).tolist()
    with pytest.raises(ValueError, match="steps 4, topk 1, draft tokens 5 verifies blocks of 5 tokens .* trained on "
                                         "blocks of 4 .*num_steps must be at most 3"):
        BlockDrafter(model, DraftShape(4))


# ---- the loss rows -------------------------------------------------------------------------------------------------


def test_each_prediction_reads_its_blocks_entry_for_the_teachers_row_of_the_token_it_predicts():
    """Prediction k of the block at a predicts x_{a+1+k}: teacher row a + k (row u predicts u + 1), at the flat index
    of (sequence, block, k). Every generated token is reached by each k whose anchor was drawn."""
    mask = torch.zeros(2, 12, dtype=torch.long)
    mask[0, 5:11], mask[1, 3:12] = 1, 1
    rows = BlockRows.drawn(mask, 3, most=100)
    batch, count = rows.anchors.shape
    for k, (at, present) in enumerate(zip(rows.steps, rows.present)):
        for u, index, here in zip(rows.teacher.tolist(), at.tolist(), present.tolist()):
            b, position = divmod(u, 12)
            if not here:
                continue
            block, slot = divmod(index, 3)
            assert slot == k and block // count == b
            assert int(rows.anchors[b, block % count]) + k == position and mask[b, position + 1] == 1
    every = LossRows.of(mask, 3)  # all anchors drawn: each step scores what EAGLE-3's step k scores
    assert [int(p.sum()) for p in rows.present] == [int(p.sum()) for p in every.present]


def test_anchors_are_capped_drawn_by_the_mask_and_agree_between_the_rows_and_the_normaliser():
    mask = torch.zeros(40, dtype=torch.long)
    mask[10:38] = 1
    drawn = anchors_of(mask, 3, most=8)
    assert len(drawn) == 8 and torch.equal(drawn, anchors_of(mask, 3, most=8)) and torch.all(drawn[1:] > drawn[:-1])
    assert anchors_of(mask, 3, most=100).tolist() == list(range(7, 37))  # blocks reaching a generated token
    config = load_config(TINY, DFLASH + ["draft.dflash.num_anchors=8"])
    entry, masks = algorithm("dflash"), torch.stack([mask, mask.roll(3), torch.zeros(40, dtype=torch.long)])
    whole = entry.normaliser(masks, 3, config.draft)
    parts = sum(entry.normaliser(masks[i : i + 1], 3, config.draft) for i in range(3))  # micro-batches of one
    assert torch.equal(whole, parts) and 0 < whole[0] <= 2 * 8


# ---- training ------------------------------------------------------------------------------------------------------


def test_the_trainer_trains_resumes_and_replays_a_dflash_draft(micro_data, tmp_path):
    overrides, run_dir = run_copy(micro_data, tmp_path, "dflash", DFLASH + [
        "draft.dflash.num_layers=2", "training.max_steps=10", "training.eval_every=5", "training.save_every=5",
        "training.replay_prompts=2", "training.ttt_step_decay=0.8669"])
    config = load_config(TINY, overrides)
    lines = []
    Trainer(config, log=lines.append).run()
    assert any("DFlash draft, 2 layer(s), block 4, mask token 5" in line for line in lines)
    steps = [m for m in metrics(run_dir) if "loss" in m]
    assert {len(m["step_acc"]) for m in steps} == {3}  # block_size - 1, not training.ttt_steps
    assert sum(m["loss"] for m in steps[-3:]) < sum(m["loss"] for m in steps[:3])
    evals = [m for m in metrics(run_dir) if "eval_time_s" in m]
    assert [m["step"] for m in evals] == [5, 10] and all(m["eval_accept_length"] >= 1.0 for m in evals)
    saved = load_file(run_dir / "train" / "final" / "model.safetensors")
    assert "fc.weight" in saved and not [name for name in saved if name.startswith(("embed", "lm_head"))]

    longer = load_config(TINY, overrides + ["training.max_steps=12"])
    lines = []
    Trainer(longer, log=lines.append).run()
    assert any("resumed from" in line and "step-0000010 at step 10" in line for line in lines), lines

    entry = algorithm("dflash")
    trained = entry.served_model(run_dir / "train" / "final", None, Path(config.target.path), "")
    refs = heldout_samples(config.run, greedy_length(config))[:2]
    rows = [replay_stored(entry, trained, ref.load(), config.replay_shape, 16, frozenset(), None) for ref in refs]
    assert all(row.completion_tokens >= 16 and 0 < row.verify_ct <= row.completion_tokens for row in rows)
    assert max(len(row.histogram) for row in rows) <= 4  # at most block_size - 1 accepted a step


def test_the_reference_server_serves_a_dflash_export_as_the_simulator_replays_it(micro, micro_data, tmp_path):
    """A trained DFlash draft exported in SGLang's layout, served by the reference server in blocks of 4 and of 3:
    every request's output, verify steps, correct drafts and histogram equal the simulator's replay of it, counted as
    0.5.13's v1 worker and 0.5.23's v2 worker count, and the server reports the block as num_draft_tokens. A block
    longer than the trained one is refused before serving."""
    overrides, run_dir = run_copy(micro_data, tmp_path, "dflash-served", DFLASH + [
        "draft.dflash.num_layers=1", "training.max_steps=30", "training.eval_every=30", "training.save_every=30",
        "training.replay_prompts=1"])
    config = load_config(TINY, overrides)
    Trainer(config, log=QUIET).run()
    entry = algorithm("dflash")
    export = entry.export(run_dir / "train" / "final", tmp_path / "sglang", "sglang",
                          ExportTarget("llama", RELEASE, 4, 3, None), QUIET)
    assert draft_algorithm(export) is entry and draft_algorithm(run_dir / "train" / "final") is entry
    draft = entry.served_model(export, RELEASE, micro["path"], "").eval()
    accepted = 0
    for shape, release in ((DraftShape(3), RELEASE), (DraftShape(2), "0.5.23")):
        with serving(micro["path"], export, shape=shape, release=release) as client:
            assert client.get("/server_info").json()["speculative_num_draft_tokens"] == shape.num_draft_tokens
            for request in requests(micro)[:3]:
                out, prompt = generate(client, **request), prompt_of(micro, request)
                row = simulate_prompt(entry, draft, micro["model"], draft.config.aux_layers, prompt, MAX_NEW, shape,
                                      frozenset({micro["eos"]}), release)
                meta = out["meta_info"]
                assert (meta["completion_tokens"], meta["spec_verify_ct"], correct_drafts_of(meta)) == (
                    row.completion_tokens, row.verify_ct, row.correct_drafts)
                assert meta.get("spec_correct_drafts_histogram", []) == row.histogram  # none kept to 0.5.13
                assert (release == RELEASE) == (row.histogram == [])
                assert meta["spec_accept_rate"] == row.correct_drafts / (row.verify_ct * shape.num_steps)
                accepted += row.correct_drafts
    assert accepted > 0  # the comparison covers accepted drafts, not only rejected blocks
    # `eagle3 simulate --draft` under the same run's EAGLE-3 config (trees among its sweep points): the export is
    # replayed as the DFlash draft it is, in serving's chain, as the DFlash config replays it
    from eagle3.bench.simulate import replay_of, simulate
    from eagle3.stages.drafts import simulate_draft

    eagle = load_config(TINY, [o for o in overrides if not o.startswith(("draft.", "sweep."))])
    assert (3, 4, 8) in eagle.sweep.points
    imported = simulate_draft(eagle, export, log=QUIET)
    own = simulate(replay_of(config), export, tmp_path / "own.json", log=QUIET)
    assert imported.shape == own.shape == DraftShape(3) and imported.rows == own.rows
    assert "verifies blocks of 5 tokens" in entry.shape_problem(export, DraftShape(4))
    with pytest.raises(ValueError, match="trained on blocks of 4"):
        create_app(micro["path"], export, shape=DraftShape(4), release=RELEASE)


def test_dflash_up_to_0_5_13_counts_only_the_drafts_a_finishing_step_appends():
    """SGLang's DFLASH v1 worker appends a run token by token and stops at the finish: of [d1, EOS, d3, bonus] it
    appends d1 and EOS and counts 1 correct draft, where EAGLE's worker (and DFLASH's from 0.5.16) counts all 3; it keeps
    no histogram (tests/conformance/test_counting.py runs each release's own code)."""
    for release, algorithm_name, correct, histogram in (("0.5.13", "DFLASH", 1, None), ("0.5.16", "DFLASH", 3, [0, 0, 0, 1]),
                                                         ("0.5.13", "EAGLE3", 3, [0, 0, 0, 1])):
        request = SpecRequest(50, frozenset({1}), release, algorithm_name)
        request.add_token(10)
        request.add_verify([11, 1, 13, 14])
        meta = request.meta_info(3)
        assert request.output == [10, 11, 1] and request.correct == correct
        assert meta.get("spec_correct_drafts_histogram") == histogram


def test_a_mask_token_the_target_generates_is_refused_before_training(micro_data, tmp_path):
    overrides, run_dir = run_copy(micro_data, tmp_path, "generated-mask", DFLASH)
    generated = load_file(next((run_dir / "data" / "hidden").glob("**/*.safetensors")))
    token = int(generated["input_ids"][generated["loss_mask"].bool()][0])
    config = load_config(TINY, overrides + [f"draft.dflash.mask_token_id={token}"])
    with pytest.raises(Eagle3Error, match=rf"target id {token} occurs \d+ time\(s\) in the target's regenerated "
                                          r"replies .*\(draft.dflash.mask_token_id\)"):
        Trainer(config, log=QUIET)
    assert not (run_dir / "train").exists()


# ---- the plan --------------------------------------------------------------------------------------------------------


def test_the_kimi_dflash_plan_fits_the_node_and_counts_its_blocks(capsys):
    """configs/kimi-k25-dflash-8xh200.yaml: a 5-layer draft of Kimi's width (2.82 B trainable), one 4,096-token
    sequence per GPU per forward with 512 blocks of 16, beside the target's eighth; the draft holds the target's head
    too; its FLOPs count 2 block positions per token, not TTT steps."""
    kimi = Path(__file__).parent.parent / "configs" / "kimi-k25-dflash-8xh200.yaml"
    config = load_config(kimi)
    assert config.data.aux_layers == [1, 15, 30, 44, 58] and config.draft.dflash.block_size == 16
    from eagle3 import cli

    assert cli.main(["plan", str(kimi), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    stages = {stage["name"]: stage for stage in plan["stages"]}
    assert plan["fits"] is True and all(stage["fits"] for stage in stages.values())
    train = stages["train"]["parts"]
    assert any(label.startswith("target head, bf16, frozen") for label in train)
    assert "training step, measured (15 predictions a position: activations, teacher, gradients)" in train
    assert any("draft.dflash.num_anchors 512 x block_size 16 / training.seq_len 4096" in line
               for line in plan["hours"]["assumptions"])
    assert 14 < plan["hours"]["total_h"] < 40


# ---- the SGLang layout -----------------------------------------------------------------------------------------------


@pytest.fixture
def exported(tmp_path):
    """A tiny draft's SGLang export, and the data manifest of the layers it was trained on."""
    from eagle3.algorithms.dflash.layout import write_sglang

    model = tiny_dflash(layers=2)
    return model, *block_export("dflash", model, write_sglang, tmp_path)


def problems(directory: Path, manifest: Path) -> dict:
    from eagle3.algorithms.dflash.layout import validate_sglang

    return {p.code: p.message for p in validate_sglang(directory, "0.5.23", manifest, 128).errors()}


def test_the_export_is_sglangs_config_and_reads_back_as_the_same_draft(exported):
    model, directory, manifest = exported
    raw = json.loads((directory / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["block_size"] == 4 and raw["num_target_layers"] == 5
    assert raw["dflash_config"] == {"target_layer_ids": [0, 1, 2], "mask_token_id": 39}
    assert problems(directory, manifest) == {}
    assert not (directory.parent / "sglang.partial").exists()


def test_a_release_that_rotates_with_another_base_is_named(exported):
    from eagle3.algorithms.dflash.layout import validate_sglang

    _, directory, manifest = exported
    for release, named in (("0.5.11", True), ("0.5.12", True), ("0.5.13", False), (None, True)):
        found = {p.code: p.message for p in validate_sglang(directory, release, manifest, 128).errors()}
        assert ("unsupported-flag" in found) == named, (release, found)
    assert "rotates every DFlash draft with RoPE base 1,000,000" in found["unsupported-flag"]


@pytest.mark.parametrize("fault, change, code, says", [
    ("ids off by one", lambda raw: raw["dflash_config"].update(target_layer_ids=[1, 2, 3]), "captured-layers-mismatch",
     r"target_layer_ids \[1, 2, 3\] make SGLang capture the outputs of layers \[1, 2, 3\], but the draft was trained "
     r"on layers \[0, 1, 2\]"),
    ("no ids", lambda raw: raw["dflash_config"].pop("target_layer_ids"), "aux-ids-missing", "SGLang spreads its own"),
    ("mask outside the vocabulary", lambda raw: raw["dflash_config"].update(mask_token_id=40), "vocab-size",
     "mask_token_id 40 is not an id of the target's 40"),
    ("no block size", lambda raw: raw.pop("block_size"), "config-field", "no block_size: SGLang takes 16"),
    ("rope base where transformers 5 does not read it", lambda raw: raw.pop("rope_parameters"), "config-field",
     "rope_parameters.rope_theta is None, rope_theta 10000.0: .*Qwen3's default 1,000,000"),
    ("another architecture", lambda raw: raw.update(architectures=["LlamaForCausalLMEagle3"]), "config-architecture",
     "SGLang serves DFlash as DFlashDraftModel"),
])
def test_each_fault_of_an_export_is_named_before_serving(exported, fault, change, code, says):
    import re

    _, directory, manifest = exported
    found = problems(rewritten(directory, change), manifest)
    assert list(found) == [code] and re.search(says, found[code]), found


# ---- speculators' layout -------------------------------------------------------------------------------------------


@pytest.fixture
def speculators_export(exported):
    """The same draft in speculators' layout, for a verifier named by its hub id, served 3 drafts a step."""
    from eagle3.draft.files import Verifier

    model, directory, manifest = exported
    target = ExportTarget("llama", None, 5, 3, Verifier("org/tiny-target", ["LlamaForCausalLM"], torch.empty(0)))
    native = directory.parent / "native"
    return model, algorithm("dflash").export(native, directory.parent / "speculators", "speculators", target, QUIET), \
        manifest


def speculators_problems(directory: Path, manifest: Path) -> dict:
    return {p.code: p.message for p in algorithm("dflash").validate(directory, "speculators", None, None, manifest,
                                                                     None).errors()}


def test_the_speculators_export_numbers_its_layers_as_speculators_and_keeps_vllm_non_causal(speculators_export):
    model, directory, manifest = speculators_export
    raw = json.loads((directory / "config.json").read_text())
    assert raw["speculators_model_type"] == "dflash" and raw["architectures"] == ["DFlashDraftModel"]
    assert raw["aux_hidden_state_layer_ids"] == [1, 2, 3]  # the inputs of layers 1..3: the outputs of 0..2
    assert raw["transformer_layer_config"]["num_hidden_layers"] == 2 and raw["draft_vocab_size"] == 40
    assert raw["sliding_window_non_causal"] is True and raw["mask_token_id"] == 39
    assert raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert raw["speculators_config"]["verifier"]["name_or_path"] == "org/tiny-target"
    assert set(load_file(directory / "model.safetensors")) == set(model.export_state())  # no embedding, no head
    assert speculators_problems(directory, manifest) == {}
    assert draft_algorithm(directory) is algorithm("dflash")


@pytest.mark.parametrize("change, code, says", [
    (lambda raw: raw.update(aux_hidden_state_layer_ids=[0, 1, 2]), "captured-layers-mismatch",
     r"aux_hidden_state_layer_ids \[0, 1, 2\] are the inputs of those layers \(the outputs of \[-1, 0, 1\]\), but "
     r"the draft was trained on the outputs of \[0, 1, 2\]"),
    (lambda raw: raw.update(sliding_window_non_causal=False), "speculators-config",
     "vLLM then masks every draft layer causally"),
    (lambda raw: raw.update(draft_vocab_size=16), "draft-vocab-size", "a reduced head"),
    (lambda raw: raw["speculators_config"]["proposal_methods"][0].update(speculative_tokens=4), "speculators-config",
     r"speculative_tokens \[4\] with block_size 4"),
    (lambda raw: raw["speculators_config"]["verifier"].update(name_or_path=None), "verifier", "name_or_path is not set"),
])
def test_each_fault_of_a_speculators_export_is_named(speculators_export, change, code, says):
    import re

    _, directory, manifest = speculators_export
    found = speculators_problems(rewritten(directory, change), manifest)
    assert list(found) == [code] and re.search(says, found[code]), found


def test_sglang_serves_the_export_by_its_own_kind_and_a_longer_block_is_refused_before_launch(exported, tmp_path):
    """The launcher reads the draft's kind from its config.json, whatever the run's draft.algorithm (production may
    serve an earlier run's version): DFLASH with the block as --speculative-num-draft-tokens, and no EAGLE shape flags.
    A serving shape whose block is longer than the trained one stops before any server starts."""
    from eagle3.serving.sglang import SGLANG
    from eagle3.serve.launch import LaunchError, launch_and_validate

    _, directory, _ = exported
    config = load_config(TINY, DFLASH + ["serving.engine=sglang", f"run.dir={tmp_path / 'run'}"])
    command = SGLANG.command(launch_spec(config), "/models/target", directory, entry=draft_algorithm(directory))
    flags = command[command.index("--speculative-algorithm"):command.index("--tp-size")]
    assert flags == ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(directory),
                     "--speculative-num-draft-tokens", "4"]
    longer = load_config(TINY, DFLASH + ["draft.dflash.block_size=8", "serving.num_steps=7",
                                         f"run.dir={tmp_path / 'run'}"])
    with pytest.raises(LaunchError, match=r"\(dflash\): steps 7, topk 1, draft tokens 8 verifies blocks of 8 tokens .* "
                                          r"trained on blocks of 4 .*nothing was launched"):
        launch_and_validate(launch_spec(longer), longer.target.path, directory, log=QUIET)


def test_production_measures_a_version_of_the_other_kind_as_its_own_kind():
    """A rollback across algorithms: a DFlash run's production check of an EAGLE-3 version takes the version's
    algorithm, so its tree shape is served; an EAGLE-3 run's of a DFlash version takes its block."""
    from eagle3.deployment.production import of_kind
    from eagle3.deployment.sweep import with_shape

    dflash, eagle = load_config(TINY, DFLASH), load_config(TINY)
    with pytest.raises(ConfigError, match="not the tree of steps 3, topk 4, draft tokens 8"):
        with_shape(dflash, DraftShape(3, 4, 8))
    back = of_kind(dflash, {"config": eagle.model_dump(mode="json")})
    assert with_shape(back, DraftShape(3, 4, 8)).serving.shape == DraftShape(3, 4, 8)
    forward = of_kind(eagle, {"config": dflash.model_dump(mode="json")})
    assert (forward.draft.algorithm, forward.draft.dflash.block_size) == ("dflash", 4)
    assert of_kind(dflash, {"config": dflash.model_dump(mode="json")}) is dflash


# ---- drafts trained elsewhere ----------------------------------------------------------------------------------------


def imported_serving():
    from eagle3.validation.external import Serving

    return Serving(family="llama", release="0.5.23", num_layers=5, vocab_size=40, data_layers=[0, 1, 2],
                   context_length=128, num_steps=3)


def as_zlab(exported_dir: Path, into: Path, change=lambda raw: None) -> Path:
    """Our SGLang export as z-lab's and SpecForge's drafts ship it: no record of ours, the tensors under `model.`."""
    into.mkdir()
    raw = json.loads((exported_dir / "config.json").read_text())
    raw.pop("eagle3")
    change(raw)
    (into / "config.json").write_text(json.dumps(raw))
    save_file({f"model.{name}": t for name, t in load_file(exported_dir / "model.safetensors").items()},
              into / "model.safetensors")
    return into


def test_a_dflash_draft_from_sglangs_or_speculators_layout_imports_as_the_same_draft(speculators_export, tmp_path):
    from eagle3.algorithms.dflash.layout import read_sglang

    model, speculators_dir, _ = speculators_export
    zlab = as_zlab(speculators_dir.parent / "sglang", tmp_path / "zlab")
    for source, layout in ((zlab, "sglang"), (speculators_dir, "speculators")):
        lines = []
        done = draft_algorithm(source).convert_external(source, tmp_path / f"from-{layout}", imported_serving(),
                                                        lines.append)
        cfg, tensors = read_sglang(tmp_path / f"from-{layout}")
        assert done.layout_found == layout and cfg.aux_layers == [0, 1, 2] and cfg.block_size == 4
        assert {name: t.tolist() for name, t in tensors.items()} == {
            name: t.tolist() for name, t in model.export_state().items()}
        assert done.draft["algorithm"] == "dflash" and done.draft["dflash"]["num_layers"] == 2
        renamed = [line for line in lines if "without their model. prefix" in line]
        assert len(renamed) == (layout == "sglang")  # z-lab's names carry it; SGLang's loader strips it


@pytest.mark.parametrize("layout, change, code, says", [
    ("sglang", lambda raw: raw["dflash_config"].update(target_layer_ids=[1, 2, 3]), "captured-layers-mismatch",
     r"make SGLang capture the outputs of layers \[1, 2, 3\], but the draft was trained on layers \[0, 1, 2\]"),
    ("sglang", lambda raw: raw.pop("block_size"), "config-field", "no block_size: SGLang takes 16"),
    ("sglang", lambda raw: raw["dflash_config"].update(mask_token_id=40), "vocab-size",
     "mask_token_id 40 is not an id of the target's 40"),
    ("sglang", lambda raw: raw.update(vocab_size=41), "vocab-size", "vocab_size 41 is not the target's 40"),
    ("speculators", lambda raw: raw.update(aux_hidden_state_layer_ids=[0, 1, 2]), "aux-ids-invalid",
     r"\[0, 1, 2\] hold 0, the embedding's output"),
    ("speculators", lambda raw: raw.update(draft_vocab_size=16), "draft-vocab-size", "a reduced head of its own"),
])
def test_each_fault_of_a_dflash_draft_from_elsewhere_is_refused_in_one_line(speculators_export, tmp_path, layout,
                                                                             change, code, says):
    import re

    from eagle3.validation.external import ImportRefused

    _, speculators_dir, _ = speculators_export
    source = (as_zlab(speculators_dir.parent / "sglang", tmp_path / "zlab", change) if layout == "sglang"
              else rewritten(speculators_dir, change))
    with pytest.raises(ImportRefused) as refused:
        draft_algorithm(source).convert_external(source, tmp_path / "converted", imported_serving(), QUIET)
    message = str(refused.value)
    assert message.startswith(f"{source}: not imported: {code}: ") and re.search(says, message), message
    assert not (tmp_path / "converted").exists()


@pytest.mark.parametrize("change, code, says", [
    (lambda tensors: tensors.pop("model.hidden_norm.weight"), "missing-tensor", "hidden_norm.weight is missing"),
    (lambda tensors: tensors.update({"model.fc.weight": torch.zeros(32, 128)}), "shape-mismatch",
     r"fc.weight is \[32, 128\], the config makes it \[32, 96\]"),  # fc's width against the target layers
    (lambda tensors: tensors.update({"model.layers.0.self_attn.qkv_proj.weight": torch.zeros(64, 32)}),
     "skipped-tensor", "layers.0.self_attn.qkv_proj.weight is no DFlashDraftModel parameter"),
])
def test_each_tensor_fault_of_a_dflash_draft_from_elsewhere_is_refused(speculators_export, tmp_path, change, code,
                                                                        says):
    from eagle3.validation.external import ImportRefused

    _, speculators_dir, _ = speculators_export
    source = as_zlab(speculators_dir.parent / "sglang", tmp_path / "zlab")
    tensors = load_file(source / "model.safetensors")
    change(tensors)
    save_file(tensors, source / "model.safetensors")
    with pytest.raises(ImportRefused, match=f"not imported: {code}: {says}"):
        draft_algorithm(source).convert_external(source, tmp_path / "converted", imported_serving(), QUIET)


def test_registry_import_publishes_a_dflash_draft_as_a_dflash_version(speculators_export, tmp_path):
    from eagle3.deployment.imports import import_draft
    from eagle3.registry.registry import open_registry, version_algorithm

    _, speculators_dir, _ = speculators_export
    config = load_config(TINY, [f"run.dir={tmp_path / 'run'}", "target.path=absent", "target.num_hidden_layers=5",
                                "target.hidden_size=32", "target.vocab_size=40", "vocab.draft_vocab_size=16",
                                "data.aux_layers=[0, 1, 2]", f"registry.path={tmp_path / 'registry'}",
                                "serving.release=0.5.23", "serving.context_length=128"])
    result = import_draft(config, str(speculators_dir), log=QUIET)
    assert result["published"] and result["layout_found"] == "speculators"
    manifest = open_registry(config.registry).manifest(result["version"])
    assert version_algorithm(manifest) == "dflash" and manifest["config"]["draft"]["dflash"]["block_size"] == 4
    assert draft_algorithm(config.run.dir / "imports" / result["version"] / "sglang") is algorithm("dflash")


def test_eagle3_convert_writes_a_dflash_draft_in_either_layout_by_hand(exported, tmp_path, capsys):
    from drafts import write_tiny_target
    from eagle3.cli import main
    from eagle3.cli.common import EXIT_PROBLEMS, EXIT_UNREADABLE

    _, sglang_dir, manifest = exported
    native, target = sglang_dir.parent / "native", write_tiny_target(tmp_path / "target")
    out = tmp_path / "by-hand"
    assert main(["convert", str(native), str(out), "--to", "speculators", "--target", str(target),
                 "--num-steps", "2"]) == 0
    raw = json.loads((out / "config.json").read_text())
    assert raw["speculators_model_type"] == "dflash" and raw["speculators_config"]["verifier"]["name_or_path"] == str(
        target.resolve()) and raw["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 2
    assert main(["validate", str(out), "--loader", "speculators", "--data-manifest", str(manifest)]) == 0
    assert main(["convert", str(sglang_dir), str(out), "--to", "speculators", "--target", str(target)]) == EXIT_PROBLEMS
    assert f"{out}: already exists" in capsys.readouterr().err
    # an export reads back as the draft it records
    assert main(["convert", str(sglang_dir), str(out), "--to", "speculators", "--target", str(target),
                 "--overwrite"]) == 0
    assert main(["convert", str(native), str(tmp_path / "n"), "--to", "native"]) == EXIT_UNREADABLE
    assert "a DFlash draft is written in SGLang's or speculators' layout" in capsys.readouterr().err
