"""DSpark drafts (docs/algorithms.md, "DSpark"): DFlash's backbone with a Markov head that drafts a block left to right
and a confidence head. The model (every entry predicts; the heads' teacher-forced latents equal drafting's steps; the
block drafted equals a plain re-computation; SGLang's tensor names), the loss against a plain computation of the
DSpark objective, the drafter, the SGLang export and each of its faults, the config refusals, SpecForge's export
imported, and the real trainer on the micro data set. A DSpark production's warm retrain is in test_retrain.py."""

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from eagle3.algorithms import algorithm, draft_algorithm
from eagle3.algorithms.dflash.blocks import BlockRows, anchors_of
from eagle3.algorithms.dflash.model import DFlashConfig, DFlashDraft
from eagle3.algorithms.dspark.contract import dspark_shape_problem
from eagle3.algorithms.dspark.model import DSparkConfig, DSparkDraft
from eagle3.algorithms.dspark.spark import SparkDrafter, spark_loss
from eagle3.errors import ConfigError
from eagle3.model.blocks import init_weights
from eagle3.model.teacher import TeacherHead
from eagle3.resolve import load_config
from eagle3.shape import DraftShape
from family_targets import DSPARK_CONFIG
from helpers import TINY, block_export, metrics, rewritten, run_copy

pytestmark = pytest.mark.usefixtures("one_thread")
QUIET = lambda line: None  # noqa: E731
PAD = 5  # the tiny tokenizers' <|pad|>: never generated
HEADS = ("vanilla", "gated", "rnn")
VOCAB, HIDDEN, AUX = 40, 32, 3


def tiny_dspark(kind="vanilla", rank=8, block=4, layers=2, seed=0, confidence=True, with_markov=True) -> DSparkDraft:
    """A tiny DSpark draft whose heads matter: norms away from 1 (a norm in the wrong place shows) and Markov tables
    large enough that their bias moves the argmax (the trainer's init starts them near zero)."""
    cfg = DSparkConfig(hidden_size=HIDDEN, target_hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=HIDDEN // 4, rms_norm_eps=1e-6,
                       rope_theta=10000.0, max_position_embeddings=256, vocab_size=VOCAB, draft_vocab_size=16,
                       torch_dtype="float32", aux_layers=list(range(AUX)), target_num_hidden_layers=AUX + 2,
                       target_family="llama", block_size=block, mask_token_id=VOCAB - 1, markov_rank=rank,
                       markov_head_type=kind, confidence_head=confidence, confidence_head_with_markov=with_markov,
                       ce_weight=0.3, l1_weight=0.9, confidence_weight=0.7)
    generator = torch.Generator().manual_seed(seed)
    model = DSparkDraft(cfg, torch.randn(VOCAB, HIDDEN, generator=generator),
                        torch.randn(VOCAB, HIDDEN, generator=generator))
    init_weights(model, seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith("markov_head."):
                param.copy_(torch.randn(param.shape, generator=generator) * (0.5 if param.dim() == 2 else 0.2))
            elif param.dim() == 1:
                param.add_(0.3 * torch.randn(param.shape, generator=generator))
    return model.eval()


def reference_latent(model: DSparkDraft, prev: int, hidden: torch.Tensor, state):
    """One entry's Markov latent as SGLang's heads compute it (srt/models/dspark.py: VanillaMarkov, GatedMarkovHead,
    RNNHead), written out: -> (latent [r], the next entry's state)."""
    head = model.markov_head
    embedded = head.markov_w1.weight[prev]
    if head.kind == "vanilla":
        return embedded, state
    if head.kind == "gated":
        gate = torch.sigmoid(head.gate_proj.weight @ torch.cat([hidden, embedded]) + head.gate_proj.bias)
        return gate * embedded, state
    state = torch.zeros_like(embedded) if state is None else state
    gate, candidate, output = (head.joint_proj.weight @ torch.cat([state, embedded, hidden])
                               + head.joint_proj.bias).chunk(3)
    gate = torch.sigmoid(gate)
    return torch.tanh(output), gate * state + (1 - gate) * torch.tanh(candidate)


def reference_block(model: DSparkDraft, hidden: torch.Tensor, anchor: int) -> list[int]:
    """A block's greedy tokens, entry by entry: the target's logits of the entry plus markov_w2 of the latent of the
    token before it (the anchor, then the entry before's draft)."""
    prev, state, tokens = anchor, None, []
    for k in range(hidden.shape[0]):
        latent, state = reference_latent(model, prev, hidden[k], state)
        prev = int((model.lm_head @ hidden[k] + model.markov_head.markov_w2.weight @ latent).argmax())
        tokens.append(prev)
    return tokens


# ---- the model -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", HEADS)
def test_the_heads_teacher_forced_latents_equal_their_step_by_step_path(kind):
    """Training's latents of whole blocks at once (each entry fed the true previous token) are what drafting's steps
    compute one entry at a time, and what SGLang's head computes (its formulas written out)."""
    torch.manual_seed(3)
    model = tiny_dspark(kind)
    prev, hidden = torch.randint(0, VOCAB, (2, 3, 4)), torch.randn(2, 3, 4, HIDDEN)
    together = model.markov_head.latents(prev, hidden)  # [2, 3, 4, r]
    assert together.shape == (2, 3, 4, 8)
    for b in range(2):
        for n in range(3):
            state, reference = None, None
            for k in range(4):
                stepped, state = model.markov_head.step(prev[b, n, k : k + 1], hidden[b, n, k : k + 1], state)
                torch.testing.assert_close(together[b, n, k], stepped[0])
                latent, reference = reference_latent(model, int(prev[b, n, k]), hidden[b, n, k], reference)
                torch.testing.assert_close(together[b, n, k], latent, rtol=1e-5, atol=1e-6)
    if kind != "vanilla":  # the stream moves the latent of the gated and recurrent heads, not the vanilla one
        assert not torch.allclose(model.markov_head.latents(prev, hidden + 1.0), together)
    if kind == "rnn":  # the recurrent state carries the block's earlier tokens into the later entries
        earlier = prev.clone()
        earlier[:, :, 0] = (earlier[:, :, 0] + 1) % VOCAB
        moved = model.markov_head.latents(earlier, hidden)
        assert not torch.allclose(moved[:, :, 1:], together[:, :, 1:])


@pytest.mark.parametrize("kind", HEADS)
def test_a_block_drafts_left_to_right_each_token_biased_by_the_one_before(kind):
    """draft_block = the plain re-computation: entry 0 (the anchor's own) drafts x_{P+1} biased by x_P, entry k by
    the draft of entry k - 1, over the target's whole head; the bias moves some token (else the test shows nothing)."""
    model = tiny_dspark(kind, seed=1)
    moved = False
    for seed in range(6):
        hidden = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(seed))
        anchor = seed * 7 % VOCAB
        tokens = model.draft_block(hidden, anchor)
        assert tokens == reference_block(model, hidden, anchor) and len(tokens) == 4
        moved |= tokens != model.greedy(hidden).tolist()
    assert moved


def test_every_entry_of_a_block_predicts_the_token_after_it():
    """The block at a is [x_a, mask x (gamma - 1)] at a .. a + gamma - 1 and its entry k predicts x_{a+1+k}: the
    loss's prediction k of that block reads entry k (not DFlash's k + 1) against teacher row a + k; the anchors drawn
    reach every generated token from each entry, as DFlash's blocks do; the kind counts gamma predictions."""
    mask = torch.zeros(2, 12, dtype=torch.long)
    mask[0, 5:11], mask[1, 3:12] = 1, 1
    rows = BlockRows.drawn(mask, 3, most=100)
    for k, (at, present) in enumerate(zip(rows.steps, rows.present)):
        for u, index, here in zip(rows.teacher.tolist(), at.tolist(), present.tolist()):
            if not here:
                continue
            b, position = divmod(u, 12)
            block, entry = divmod(index, 3)
            assert entry == k and int(rows.anchors[b, block % rows.anchors.shape[1]]) + k == position
            assert mask[b, position + 1] == 1
    config = load_config(DSPARK_CONFIG)
    assert algorithm("dspark").predictions(config.draft, config.training) == config.draft.dspark.block_size == 3
    model = tiny_dspark(block=3)
    hidden = model.blocks(model.context(torch.randn(1, 9, AUX * HIDDEN)), torch.tensor([[7]]), torch.tensor([[6]]))
    assert hidden.shape == (1, 1, 3, HIDDEN)  # gamma entries, the anchor's included: gamma drafts


@pytest.mark.parametrize("kind", HEADS)
def test_the_export_holds_sglangs_names_dflashs_backbone_and_the_two_heads(kind):
    model = tiny_dspark(kind, layers=2)
    names = set(model.export_state())
    backbone = DFlashDraft(DFlashConfig(**{name: value for name, value in model.config.model_dump().items()
                                            if name in DFlashConfig.model_fields and name != "format"}),
                           torch.zeros(VOCAB, HIDDEN))
    heads = {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
             "confidence_head.proj.bias"}
    heads |= {"gated": {"markov_head.gate_proj.weight", "markov_head.gate_proj.bias"},
              "rnn": {"markov_head.joint_proj.weight", "markov_head.joint_proj.bias"}}.get(kind, set())
    assert names == set(backbone.export_state()) | heads
    state = model.export_state()
    assert state["markov_head.markov_w1.weight"].shape == state["markov_head.markov_w2.weight"].shape == (VOCAB, 8)
    assert state["confidence_head.proj.weight"].shape == (1, HIDDEN + 8)  # the stream and the Markov row
    if kind == "gated":
        assert state["markov_head.gate_proj.weight"].shape == (8, HIDDEN + 8)
    if kind == "rnn":
        assert state["markov_head.joint_proj.weight"].shape == (24, 2 * 8 + HIDDEN)
    assert "confidence_head.proj.weight" not in tiny_dspark(kind, confidence=False).export_state()
    assert tiny_dspark(kind, with_markov=False).export_state()["confidence_head.proj.weight"].shape == (1, HIDDEN)
    clone = tiny_dspark(kind, seed=5)
    clone.load_draft_state(state)
    clone.lm_head.copy_(model.lm_head)
    hidden = torch.randn(4, HIDDEN)
    assert clone.draft_block(hidden, 3) == model.draft_block(hidden, 3)


# ---- the loss ------------------------------------------------------------------------------------------------------


def loss_batch(model: DSparkDraft, seed=0):
    """A tiny batch: features, tokens, a loss mask of generated tokens, the rows of every anchor's block, and the
    teacher (a random target head whose draft vocabulary misses some of its argmaxes) at those rows and everywhere."""
    generator = torch.Generator().manual_seed(seed)
    aux = torch.randn(2, 14, AUX * HIDDEN, generator=generator)
    ids = torch.randint(0, VOCAB - 1, (2, 14), generator=generator)
    mask = torch.zeros(2, 14, dtype=torch.long)
    mask[0, 4:13], mask[1, 6:14] = 1, 1
    model.loss_ids.copy_(torch.randperm(VOCAB - 1, generator=generator)[:16])
    rows = BlockRows.drawn(mask, model.config.block_size, most=100)
    head = TeacherHead(torch.randn(VOCAB, HIDDEN, generator=generator), model.loss_ids)
    last = torch.randn(2, 14, HIDDEN, generator=generator)
    return aux, ids, mask, rows, head(last, rows.teacher), head(last)


def plain_loss(model: DSparkDraft, aux, ids, mask, everywhere) -> tuple[list, list]:
    """Each prediction's summed loss and count, block by block over the context before its anchor:
    ce_weight * H(q, p) + l1_weight * sum|p - q| + confidence_weight * BCE(conf, 1 - sum|p - q| / 2), p the draft's
    softmax over the draft vocabulary with the Markov bias of the true previous token, q the teacher's there."""
    cfg = model.config
    gamma, (batch, length) = cfg.block_size, ids.shape
    head, bias_rows = model.lm_head[model.loss_ids], model.markov_head.markov_w2.weight[model.loss_ids]
    losses, counts = [torch.zeros(()) for _ in range(gamma)], [0] * gamma
    for b in range(batch):
        context = model.context(aux[b : b + 1])
        for a in anchors_of(mask[b], gamma, most=100).tolist():
            prefix = [(k[:, :, :a], v[:, :, :a]) for k, v in context]
            hidden = model.blocks(prefix, ids[b : b + 1, a : a + 1], torch.tensor([[a]]))[0, 0]
            state = None
            for k in range(gamma):
                u = a + k  # entry k predicts x_{u+1}: the teacher's row u
                if u + 1 >= length:
                    break
                latent, state = reference_latent(model, int(ids[b, u]), hidden[k], state)
                if not mask[b, u + 1] or everywhere.draft_argmax[b, u] < 0:
                    continue
                z = head @ hidden[k] + bias_rows @ latent
                p, q = F.softmax(z, -1), everywhere.probs[b, u]
                l1 = (p - q).abs().sum()
                features = torch.cat([hidden[k], model.markov_head.markov_w1.weight[int(ids[b, u])]])
                confidence = model.confidence_head.proj.weight[0] @ features + model.confidence_head.proj.bias[0]
                losses[k] = losses[k] + (cfg.ce_weight * -(q * F.log_softmax(z, -1)).sum() + cfg.l1_weight * l1
                                         + cfg.confidence_weight * F.binary_cross_entropy_with_logits(
                                             confidence, 1 - l1.detach() / 2))
                counts[k] += 1
    return losses, counts


@pytest.mark.parametrize("kind", HEADS)
def test_the_loss_is_the_dspark_objective_computed_plainly(kind):
    model = tiny_dspark(kind, block=3)
    aux, ids, mask, rows, teacher, everywhere = loss_batch(model)
    stats = spark_loss(model, aux, ids, teacher, rows)
    losses, counts = plain_loss(model, aux, ids, mask, everywhere)
    assert stats.count.tolist() == counts and min(counts) > 0
    assert (teacher.draft_argmax < 0).any()  # rows whose target token the draft vocabulary lacks count nowhere
    torch.testing.assert_close(stats.loss_sum, torch.stack(losses), rtol=1e-4, atol=1e-5)


def test_the_losss_gradient_reaches_both_markov_tables_and_the_confidence_head():
    """Through the bias (markov_w1's rows reach the loss only through markov_w2 with the confidence head reading the
    stream alone), and from the trainer's start: markov_w2 at zero still learns."""
    model = tiny_dspark(block=3, with_markov=False)
    aux, ids, _, rows, teacher, _ = loss_batch(model)
    spark_loss(model, aux, ids, teacher, rows).loss_sum.sum().backward()
    for name in ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
                 "confidence_head.proj.bias", "fc.weight"):
        grad = model.get_parameter(name).grad
        assert grad is not None and grad.abs().sum() > 0, name
    fresh = tiny_dspark(block=3)
    fresh.reset_heads()
    assert fresh.markov_head.markov_w2.weight.abs().sum() == 0 and fresh.confidence_head.proj.bias.item() == 0
    spark_loss(fresh, aux, ids, teacher, rows).loss_sum.sum().backward()
    assert fresh.markov_head.markov_w2.weight.grad.abs().sum() > 0
    assert fresh.markov_head.markov_w1.weight.grad.abs().sum() > 0  # the confidence head reads its rows


def test_a_few_training_steps_lower_the_loss():
    torch.manual_seed(0)
    model = tiny_dspark("gated", block=3).train()
    aux, ids, _, rows, teacher, _ = loss_batch(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(8):
        optimizer.zero_grad()
        loss = spark_loss(model, aux, ids, teacher, rows).loss_sum.sum()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses


# ---- drafting --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", HEADS)
def test_the_drafter_drafts_what_a_block_drafted_from_scratch_drafts(kind):
    """The context kept as the prefix grows (an earlier verify step made positions 0..3) equals the one made at once:
    the chain is the block at P = 6 drafted over aux[:6] from nothing."""
    torch.manual_seed(2)
    model = tiny_dspark(kind, block=3)
    aux, ids = torch.randn(12, AUX * HIDDEN), torch.randint(0, VOCAB - 1, (12,))
    drafter = SparkDrafter(model, DraftShape(3))
    drafter(aux[:4], ids[:5])
    tree = drafter(aux[:6], ids[:7])
    hidden = model.blocks(model.context(aux[None, :6]), ids[6].view(1, 1), torch.tensor([[6]]))[0, 0]
    assert tree.tokens == reference_block(model, hidden, int(ids[6])) and tree.parents == [-1, 0, 1]
    assert SparkDrafter(model, DraftShape(3))(aux[:6], ids[:7]).tokens == tree.tokens


def test_the_drafter_refuses_a_shape_sglang_would_not_serve_naming_it():
    model = tiny_dspark(block=3)
    with pytest.raises(ValueError, match=r"one chain a step, not the tree of steps 3, topk 2, draft tokens 4: "
                                         "eagle_topk must be 1"):
        SparkDrafter(model, DraftShape(3, 2, 4))
    with pytest.raises(ValueError, match=r"steps 2, topk 1, draft tokens 3 drafts 2 tokens a step, but the draft's "
                                         r"block is 3 \(block_size\): SGLang refuses --speculative-num-draft-tokens "
                                         "other than 4; serve num_steps 3"):
        SparkDrafter(model, DraftShape(2))
    # a chain whose window is not its steps + 1: DraftShape refuses it itself; the DSpark rule names it too
    window = SimpleNamespace(eagle_topk=1, num_steps=3, num_draft_tokens=5, label=lambda: "steps 3, draft tokens 5")
    assert "num_draft_tokens must be num_steps + 1" in dspark_shape_problem(3, window)
    assert dspark_shape_problem(3, DraftShape(3)) is None


# ---- the config ------------------------------------------------------------------------------------------------------


MLA = ["draft.attention=mla", "draft.num_key_value_heads=null", "draft.q_lora_rank=96", "draft.kv_lora_rank=64",
       "draft.qk_nope_head_dim=32", "draft.qk_rope_head_dim=16", "draft.v_head_dim=32"]


@pytest.mark.parametrize("overrides, says", [
    (["serving.release=0.5.13"], r"draft.algorithm dspark, serving.release 0.5.13: SGLang 0.5.13 has no DSPARK "
                                 r"speculative algorithm .*serve with SGLang 0.5.16"),
    (["target.family=qwen2"], "draft.algorithm dspark with target.family qwen2: SGLang's qwen2 model cannot hand a "
                              "DSpark draft its target's layers"),
    (["serving.eagle_topk=2"], r"draft.algorithm dspark, serving: a DSpark draft proposes one chain a step, not the "
                               r"tree of steps 3, topk 2, draft tokens 4: eagle_topk must be 1"),
    (["serving.num_steps=2"], r"draft.algorithm dspark, serving: steps 2, topk 1, draft tokens 3 drafts 2 tokens a "
                              r"step, but the draft's block is 3 \(block_size\).*draft.dspark.block_size"),
    (["sweep.points=[[4, 1, 5]]"], r"draft.algorithm dspark, sweep.points\[0\]: steps 4, topk 1, draft tokens 5 "
                                   r"drafts 4 tokens a step, but the draft's block is 3"),
    (["draft.dspark.mask_token_id=2048"], r"draft.dspark.mask_token_id 2048 is outside the target's vocabulary "
                                          r"\(0 .. 2047\)"),
    (MLA, "draft.algorithm dspark has Qwen3-style layers: draft.attention mha"),
    (["draft.fc_norm=true"], "draft.algorithm dspark has Qwen3-style layers: draft.attention mha, and none of "
                             "draft.fc_norm"),
    (["draft.dspark.markov_head=lstm"], r"draft.dspark.markov_head .*'vanilla', 'gated' or 'rnn'"),
    (["draft.dspark.markov_rank=0"], "draft.dspark.markov_rank .*greater than 0"),
])
def test_a_dspark_config_sglang_cannot_serve_is_refused_at_load_naming_the_field(overrides, says):
    with pytest.raises(ConfigError, match=says):
        load_config(DSPARK_CONFIG, overrides)


def test_vllm_refuses_a_dspark_config_before_any_stage():
    """vLLM's CPU build drafts no DSpark (tests/conformance/test_vllm_dspark.py), and the launcher serves the
    speculators layout: its check, which the run's load-config calls, names the kind and the engine to use."""
    from eagle3.serving import serving_engine
    from eagle3.serving.base import launch_spec
    from eagle3.procs import LaunchError

    config = load_config(DSPARK_CONFIG, ["serving.engine=vllm"])
    with pytest.raises(LaunchError, match=r"draft.algorithm dspark: vLLM serves eagle3, dflash drafts here .*choose "
                                          r"serving.engine sglang"):
        serving_engine("vllm").check(launch_spec(config), config.production.telemetry, config.sweep)


def test_the_shipped_dspark_config_serves_the_chain_of_its_gamma():
    """configs/tiny-dspark-cpu.yaml: two layers, gamma 3 served in a window of 4, SGLang 0.5.23, its own registry."""
    config = load_config(DSPARK_CONFIG)
    spark = config.draft.dspark
    assert (config.draft.algorithm, spark.num_layers, spark.block_size, spark.markov_rank) == ("dspark", 2, 3, 16)
    assert config.serving.shape == DraftShape(3) and config.sweep.points == [] and config.serving.release == "0.5.23"
    assert config.registry.path != load_config(TINY).registry.path
    with pytest.raises(ConfigError, match="draft.dspark.mask_token_id"):
        load_config(TINY, ["draft.algorithm=dspark", "serving.release=0.5.23", "sweep.points=[]"])


# ---- the SGLang layout -----------------------------------------------------------------------------------------------


@pytest.fixture
def exported(tmp_path):
    """A tiny draft's SGLang export (gamma 3, vanilla head of rank 8), and the data manifest of its layers."""
    from eagle3.algorithms.dspark.layout import write_sglang

    model = tiny_dspark(block=3)
    return model, *block_export("dspark", model, write_sglang, tmp_path)


def retensored(directory: Path, change) -> Path:
    tensors = load_file(directory / "model.safetensors")
    change(tensors)
    save_file(tensors, directory / "model.safetensors")
    return directory


def problems(directory: Path, manifest: Path, release="0.5.23") -> dict:
    from eagle3.algorithms.dspark.layout import validate_sglang

    return {p.code: p.message for p in validate_sglang(directory, release, manifest, 128).errors()}


def test_the_export_is_sglangs_dspark_config_and_reads_back_as_the_same_draft(exported):
    from eagle3.algorithms.dspark.layout import read_sglang

    model, directory, manifest = exported
    raw = json.loads((directory / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3DSparkModel"] and raw["model_type"] == "qwen3" and raw["block_size"] == 3
    head = {"markov_rank": 8, "markov_head_type": "vanilla", "enable_confidence_head": True,
            "confidence_head_with_markov": True, "sample_from_anchor": True}
    assert {name: raw[name] for name in head} == head  # the top level: what SGLang's and vLLM's models read
    for nested in ("dflash_config", "dspark_config"):  # what the spec parsers and SpecForge read
        assert raw[nested] == {"target_layer_ids": [0, 1, 2], "mask_token_id": 39, "block_size": 3, **head}
    assert problems(directory, manifest) == {}
    cfg, tensors = read_sglang(directory)
    assert cfg == model.config and {n: t.tolist() for n, t in tensors.items()} == {
        n: t.tolist() for n, t in model.export_state().items()}
    assert draft_algorithm(directory) is algorithm("dspark")
    for release, named in (("0.5.13", True), ("0.5.16", False), ("0.5.21", False), (None, False)):
        assert ("unsupported-flag" in problems(directory, manifest, release)) == named, release


def nested(name, value):
    """Set `name` where every reader looks: the top level and both nested configs."""
    def change(raw):
        for where in (raw, raw["dflash_config"], raw["dspark_config"]):
            where[name] = value
    return change


def dropped(name):
    def change(raw):
        for where in (raw, raw["dflash_config"], raw["dspark_config"]):
            where.pop(name, None)
    return change


def only(nest, name, value):
    """Set `name` in one nested config: what SGLang's spec parser reads before the top level."""
    return lambda raw: raw[nest].update({name: value})


@pytest.mark.parametrize("fault, change, code, says", [
    ("wrong rank", nested("markov_rank", 16), "shape-mismatch",
     "markov_rank 16, .*dspark_config.markov_rank 16, but the draft was trained with 8"),
    ("wrong rank where the spec parser reads it", only("dspark_config", "markov_rank", 0), "shape-mismatch",
     "^dspark_config.markov_rank 0, but the draft was trained with 8"),
    ("no rank", dropped("markov_rank"), "config-field", "markov_rank is None: SGLang refuses a DSpark draft without a "
                                                        "Markov head"),
    ("another head type", nested("markov_head_type", "gated"), "config-field",
     "markov_head_type gated, .*but the draft was trained with a vanilla head"),
    ("an unknown head type", nested("markov_head_type", "lstm"), "config-field",
     "markov_head_type is lstm: SGLang refuses .*vanilla, gated, rnn"),
    ("mask outside the vocabulary", nested("mask_token_id", 40), "vocab-size",
     "^mask_token_id 40, dflash_config.mask_token_id 40, dspark_config.mask_token_id 40: not an id of the "
     "target's 40"),
    ("no mask", dropped("mask_token_id"), "vocab-size", "no dflash_config.mask_token_id: not an id"),
    ("another mask", nested("mask_token_id", 38), "config-field",
     "mask_token_id 38, but the draft was trained with 39"),
    ("another mask where the worker reads it", only("dspark_config", "mask_token_id", 38), "config-field",
     "^dspark_config.mask_token_id 38, but the draft was trained with 39 at its blocks' unknown entries"),
    ("ids off by one", nested("target_layer_ids", [1, 2, 3]), "captured-layers-mismatch",
     r"target_layer_ids \[1, 2, 3\] make SGLang capture the outputs of layers \[1, 2, 3\], but the draft was trained "
     r"on layers \[0, 1, 2\]"),
    ("no block size", dropped("block_size"), "config-field", "no block_size"),
    ("another gamma where SGLang reads it first", only("dflash_config", "block_size", 4), "config-field",
     "^dflash_config.block_size 4, but the draft's gamma is 3: SGLang takes gamma from dflash_config.block_size "
     r"\(else the top level\) and refuses --speculative-num-draft-tokens 4"),
    ("another architecture", lambda raw: raw.update(architectures=["DSparkDraftModel"]), "config-architecture",
     "every SGLang release with DSPARK serves it as Qwen3DSparkModel"),
    ("no confidence width", dropped("confidence_head_with_markov"), "config-field",
     "no confidence_head_with_markov: SGLang then builds the head over the Markov row too, vLLM without it"),
    ("another confidence width", lambda raw: raw.update(confidence_head_with_markov=False), "shape-mismatch",
     "^confidence_head_with_markov False, but the draft's confidence head was trained with the Markov row"),
])
def test_each_fault_of_an_export_is_named_with_its_field(exported, fault, change, code, says):
    _, directory, manifest = exported
    found = problems(rewritten(directory, change), manifest)
    assert list(found) == [code] and re.search(says, found[code]), found


@pytest.mark.parametrize("fault, change, code, says", [
    ("missing tensor", lambda t: t.pop("markov_head.markov_w2.weight"), "missing-tensor",
     "markov_head.markov_w2.weight is missing"),
    ("missing confidence", lambda t: t.pop("confidence_head.proj.bias"), "missing-tensor",
     "confidence_head.proj.bias is missing"),
    ("extra tensor", lambda t: t.update({"markov_head.gate_proj.weight": torch.zeros(8, HIDDEN + 8)}),
     "skipped-tensor",
     "markov_head.gate_proj.weight is no parameter of the draft's Markov head: SGLang's DSpark loader refuses it"),
    ("another rank's table", lambda t: t.update({"markov_head.markov_w1.weight": torch.zeros(VOCAB, 4)}),
     "shape-mismatch", r"markov_head.markov_w1.weight is \[40, 4\], the config makes it \[40, 8\]"),
])
def test_each_tensor_fault_of_an_export_is_named(exported, fault, change, code, says):
    _, directory, manifest = exported
    found = problems(retensored(directory, change), manifest)
    assert list(found) == [code] and re.search(says, found[code]), found


# ---- drafts trained elsewhere ----------------------------------------------------------------------------------------


def imported_serving(num_steps=3):
    from eagle3.validation.external import Serving

    return Serving(family="llama", release="0.5.23", num_layers=5, vocab_size=VOCAB, data_layers=[0, 1, 2],
                   context_length=128, num_steps=num_steps)


def as_specforge(model: DSparkDraft, into: Path, change=lambda raw: None, prefixed=False) -> Path:
    """The draft as SpecForge 0.2.0 exports it (`export/to_hf.py`: save_pretrained of its DSparkDraftModel, a Qwen3
    config under transformers 5): the heads' fields in dflash_config only (dspark.py _init_draft_head), block_size
    and num_target_layers at the top, q/k/v apart, no embedding or head (a DFlash-family draft owns none). `prefixed`:
    as published drafts ship it, the tensors under `model.` and the target's embedding and head beside them."""
    cfg = model.config
    raw = {
        "architectures": ["DSparkDraftModel"], "model_type": "qwen3", "attention_bias": False, "attention_dropout": 0.0,
        "block_size": cfg.block_size, "bos_token_id": None, "eos_token_id": None, "pad_token_id": 0,
        "dflash_config": {"attention_mode": "gqa", "projector_type": "dspark", "target_layer_ids": cfg.aux_layers,
                          "mask_token_id": cfg.mask_token_id, "markov_rank": cfg.markov_rank,
                          "markov_head_type": cfg.markov_head_type, "enable_confidence_head": cfg.confidence_head,
                          "confidence_head_with_markov": cfg.confidence_head_with_markov},
        "draft_vocab_size": cfg.vocab_size, "dtype": "float32", "head_dim": cfg.head_dim, "hidden_act": "silu",
        "hidden_size": cfg.hidden_size, "initializer_range": 0.02, "intermediate_size": cfg.intermediate_size,
        "layer_types": ["full_attention"] * cfg.num_hidden_layers,
        "max_position_embeddings": cfg.max_position_embeddings, "max_window_layers": 28,
        "num_attention_heads": cfg.num_attention_heads, "num_hidden_layers": cfg.num_hidden_layers,
        "num_key_value_heads": cfg.num_key_value_heads, "num_target_layers": cfg.target_num_hidden_layers,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
        "sliding_window": None, "tie_word_embeddings": False, "transformers_version": "5.8.1", "use_cache": True,
        "use_sliding_window": False, "vocab_size": cfg.vocab_size,
    }
    change(raw)
    into.mkdir()
    (into / "config.json").write_text(json.dumps(raw, indent=2))
    tensors = model.export_state()
    if prefixed:
        tensors = {f"model.{name}": t for name, t in tensors.items()}
        tensors.update({"model.embed_tokens.weight": model.embed_tokens.weight.detach().clone(),
                        "lm_head.weight": model.lm_head.clone()})
    save_file(tensors, into / "model.safetensors")
    return into


@pytest.mark.parametrize("kind, prefixed, confidence, with_markov", [
    ("vanilla", False, True, False), ("rnn", False, False, False), ("gated", True, True, True),
])
def test_a_specforge_dspark_export_imports_as_the_same_draft_in_sglangs_layout(tmp_path, kind, prefixed, confidence,
                                                                                with_markov):
    from eagle3.algorithms.dspark.layout import read_sglang, validate_sglang

    model = tiny_dspark(kind, block=3, confidence=confidence, with_markov=with_markov)
    source = as_specforge(model, tmp_path / "specforge", prefixed=prefixed)
    entry = draft_algorithm(source)
    assert entry is algorithm("dspark")
    lines = []
    done = entry.convert_external(source, tmp_path / "converted", imported_serving(), lines.append)
    cfg, tensors = read_sglang(tmp_path / "converted")
    assert done.layout_found == "sglang" and cfg.aux_layers == [0, 1, 2] and cfg.block_size == 3
    assert (cfg.markov_rank, cfg.markov_head_type, cfg.mask_token_id) == (8, kind, VOCAB - 1)
    assert (cfg.confidence_head, cfg.confidence_head_with_markov) == (confidence, with_markov)
    assert (cfg.rope_theta, cfg.torch_dtype, cfg.target_num_hidden_layers) == (10000.0, "float32", 5)
    assert {name: t.tolist() for name, t in tensors.items()} == {
        name: t.tolist() for name, t in model.export_state().items()}
    assert validate_sglang(tmp_path / "converted", "0.5.23", None, 128, captured=[0, 1, 2]).errors() == []
    raw = json.loads((tmp_path / "converted" / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3DSparkModel"] and raw["markov_rank"] == 8  # at the top, where SGLang reads
    assert done.draft["algorithm"] == "dspark" and done.draft["dspark"]["markov_head"] == kind
    assert any("embed_tokens.weight, lm_head.weight" in line for line in lines) == prefixed


def test_a_specforge_export_without_the_confidence_fields_takes_specforges_defaults(tmp_path):
    """SpecForge builds the confidence head only when asked (enable_confidence_head, default confidence_head_alpha >
    0) and over the stream alone (confidence_head_with_markov, default False): an export that leaves both out holds
    the head its tensors say, of the width its weight has."""
    def unsaid(raw):
        for name in ("enable_confidence_head", "confidence_head_with_markov"):
            raw["dflash_config"].pop(name)

    for confidence, with_markov in ((False, False), (True, False), (True, True)):
        model = tiny_dspark(block=3, confidence=confidence, with_markov=with_markov)
        source = as_specforge(model, tmp_path / f"specforge-{confidence}-{with_markov}", unsaid)
        converted = tmp_path / f"converted-{confidence}-{with_markov}"
        algorithm("dspark").convert_external(source, converted, imported_serving(), QUIET)
        raw = json.loads((converted / "config.json").read_text())
        assert (raw["enable_confidence_head"], raw["confidence_head_with_markov"]) == (confidence, with_markov)
        assert ("confidence_head.proj.weight" in load_file(converted / "model.safetensors")) == confidence


def test_a_published_sglang_layout_dspark_draft_imports_with_its_fields_where_sglang_reads_them(tmp_path):
    """SGLang's own layout as published DSpark drafts ship it (Qwen3DSparkModel): the heads' fields at the top level,
    the mask token in dspark_config alone (where SGLang's DSpark worker reads it first), the ids in dflash_config."""
    def published(raw):
        spark = raw.pop("dflash_config")
        raw.update(architectures=["Qwen3DSparkModel"], markov_rank=spark.pop("markov_rank"),
                   markov_head_type=spark.pop("markov_head_type"), enable_confidence_head=True,
                   confidence_head_with_markov=True, dflash_config={"target_layer_ids": spark.pop("target_layer_ids")},
                   dspark_config={"mask_token_id": spark.pop("mask_token_id")})

    model = tiny_dspark("gated", block=3)
    source = as_specforge(model, tmp_path / "published", published)
    assert draft_algorithm(source) is algorithm("dspark")
    algorithm("dspark").convert_external(source, tmp_path / "converted", imported_serving(), QUIET)
    raw = json.loads((tmp_path / "converted" / "config.json").read_text())
    assert raw["dflash_config"]["mask_token_id"] == raw["dspark_config"]["mask_token_id"] == VOCAB - 1
    assert (raw["markov_rank"], raw["markov_head_type"], raw["confidence_head_with_markov"]) == (8, "gated", True)


@pytest.mark.parametrize("change, code, says", [
    (lambda raw: raw["dflash_config"].pop("markov_rank"), "config-field",
     "markov_rank is None: SGLang serves no DSpark draft without a Markov head"),
    (lambda raw: raw["dflash_config"].update(markov_rank=0), "config-field", "markov_rank is 0"),
    (lambda raw: raw["dflash_config"].update(markov_head_type="lstm"), "config-field",
     "markov_head_type lstm is none of vanilla, gated, rnn"),
    (lambda raw: raw["dflash_config"].update(target_layer_ids=[1, 2, 3]), "captured-layers-mismatch",
     r"make SGLang capture the outputs of layers \[1, 2, 3\], but the draft was trained on layers \[0, 1, 2\]"),
    (lambda raw: raw["dflash_config"].update(mask_token_id=40), "vocab-size",
     "mask_token_id 40 is not an id of the target's 40"),
    (lambda raw: raw.pop("block_size"), "config-field", "no block_size"),
    (lambda raw: raw.update(vocab_size=41), "vocab-size", "vocab_size 41 is not the target's 40"),
])
def test_each_fault_of_a_dspark_draft_from_elsewhere_is_refused_in_one_line(tmp_path, change, code, says):
    from eagle3.validation.external import ImportRefused

    source = as_specforge(tiny_dspark(block=3), tmp_path / "specforge", change)
    with pytest.raises(ImportRefused) as refused:
        algorithm("dspark").convert_external(source, tmp_path / "converted", imported_serving(), QUIET)
    message = str(refused.value)
    assert message.startswith(f"{source}: not imported: {code}: ") and re.search(says, message), message
    assert not (tmp_path / "converted").exists()


def test_registry_import_publishes_a_specforge_dspark_draft_as_a_dspark_version(tmp_path):
    from eagle3.deployment.imports import import_draft
    from eagle3.registry.registry import open_registry, version_algorithm

    source = as_specforge(tiny_dspark(block=3), tmp_path / "specforge")
    config = load_config(TINY, [f"run.dir={tmp_path / 'run'}", "target.path=absent", "target.num_hidden_layers=5",
                                "target.hidden_size=32", "target.vocab_size=40", "vocab.draft_vocab_size=16",
                                "data.aux_layers=[0, 1, 2]", f"registry.path={tmp_path / 'registry'}",
                                "serving.release=0.5.23", "serving.context_length=128"])
    result = import_draft(config, str(source), log=QUIET)
    assert result["published"] and result["layout_found"] == "sglang"
    manifest = open_registry(config.registry).manifest(result["version"])
    assert version_algorithm(manifest) == "dspark" and manifest["config"]["draft"]["dspark"]["block_size"] == 3
    assert draft_algorithm(config.run.dir / "imports" / result["version"] / "sglang") is algorithm("dspark")


# ---- training ------------------------------------------------------------------------------------------------------


def test_a_dspark_warm_start_loads_both_heads_and_refuses_another_head(tmp_path):
    """From an SGLang export (what a registry version holds): backbone and heads carried over, the objective's
    weights and gamma trained anew and named; another rank, head or confidence width refused, naming the field."""
    from eagle3.algorithms.dspark.layout import write_sglang
    from eagle3.algorithms.dspark.warm_start import warm_start
    from eagle3.algorithms.init_copy import ResolvedInit
    from eagle3.errors import Eagle3Error

    model = tiny_dspark("rnn", block=3)
    algorithm("dspark").write_draft(model.config, model.export_state(), tmp_path, {})
    export, copy = write_sglang(tmp_path, tmp_path / "sglang"), tmp_path / "copy"
    algorithm("dspark").warm_start_copy(export, copy, None, "v1", QUIET)
    init = ResolvedInit(copy, {"init_from": "v1", "kind": "version", "where": "registry", "layout": "sglang",
                               "sha256": "0" * 64})
    ours = DSparkDraft(model.config.model_copy(update={"ce_weight": 1.0, "block_size": 4}), model.embed_tokens.weight)
    lines = []
    warm_start(ours, init, lines.append)
    assert lines == ["train: warm start from v1 (version registry, sglang layout, sha256 0000000000000000); trained "
                     "with this config's block_size 3 -> 4, ce_weight 0.3 -> 1.0"]
    assert {n: t.tolist() for n, t in ours.export_state().items()} == {
        n: t.tolist() for n, t in model.export_state().items()}
    for field, value in (("markov_rank", 16), ("markov_head_type", "gated"), ("confidence_head_with_markov", False)):
        other = DSparkDraft(model.config.model_copy(update={field: value}), model.embed_tokens.weight)
        with pytest.raises(Eagle3Error, match=f"cannot warm start from training.init_from v1 .*: {field} "):
            warm_start(other, init, QUIET)


def test_the_trainer_trains_and_replays_a_dspark_draft(micro_data, tmp_path):
    """configs/tiny-dspark-cpu.yaml's draft (one layer here) on the micro data: gamma predictions a step, the loss
    falls, the checkpoint holds both heads, and the trained draft replays as the chain of its gamma."""
    from eagle3.bench.simulate import heldout_samples, replay_stored
    from eagle3.data.regenerate import greedy_length
    from eagle3.train.trainer import Trainer

    overrides, run_dir = run_copy(micro_data, tmp_path, "dspark", [
        "draft.algorithm=dspark", "draft.dspark.num_layers=1", "draft.dspark.block_size=3",
        "draft.dspark.markov_rank=8",
        f"draft.dspark.mask_token_id={PAD}", "serving.release=0.5.23", "sweep.points=[]", "training.max_steps=10",
        "training.eval_every=5", "training.save_every=5", "training.replay_prompts=2"])
    config = load_config(TINY, overrides)
    lines = []
    Trainer(config, log=lines.append).run()
    assert any("DSpark draft, 1 layer(s), gamma 3, vanilla Markov head of rank 8, confidence head on, mask token 5"
               in line for line in lines), lines
    steps = [m for m in metrics(run_dir) if "loss" in m]
    assert {len(m["step_acc"]) for m in steps} == {3}  # gamma: the anchor's entry predicts too
    assert sum(m["loss"] for m in steps[-3:]) < sum(m["loss"] for m in steps[:3])
    saved = load_file(run_dir / "train" / "final" / "model.safetensors")
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight"} <= set(saved)
    assert not [name for name in saved if name.startswith(("embed", "lm_head"))]
    entry = algorithm("dspark")
    trained = entry.served_model(run_dir / "train" / "final", None, Path(config.target.path), "")
    refs = heldout_samples(config.run, greedy_length(config))[:2]
    rows = [replay_stored(entry, trained, ref.load(), config.replay_shape, 16, frozenset(), None) for ref in refs]
    assert all(row.completion_tokens >= 16 and 0 < row.verify_ct <= row.completion_tokens for row in rows)
    assert max(len(row.histogram) for row in rows) <= 4  # at most gamma accepted a step, and the bonus
