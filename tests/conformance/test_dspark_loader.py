"""Our DSpark export (eagle3.algorithms.dspark.layout) against each SGLang release's own code.

Releases with DSpark (releases.DSPARK_RELEASES), through inside/loader.py and inside/dflash_forward.py: the release
builds Qwen3DSparkModel from our config.json, and every parameter it builds is written whole from our tensors: the
backbone (DFlash's), the Markov head of each type, and the confidence head where the release builds one. It builds
none in SGLang's default static verify (SGLANG_RAGGED_VERIFY_MODE=static) and drops our confidence tensors there;
the `confidence` draft loads under cap-accept, so the head is built and loaded. Then one block through its loaded
modules and its own DSPARK heads equals ours: the stream, the base logits, base + Markov bias at each step, the
greedy block, and the confidence. For each fault, what the loader does and what our validation says agree. Where
SGLang loads a fault silently (a missing Markov tensor stays at its initialisation), our validation still refuses it.

Releases without DSpark (releases.NO_DSPARK_RELEASES) refuse `--speculative-algorithm DSPARK` in their own CLI
parser or ServerArgs. Our config refuses a DSpark draft that names such a serving.release, in one line.

The probes' ServerArgs name EAGLE3, as DFlash's do: every DSpark release's CPU platform refuses DSPARK in ServerArgs
("DSpark speculative decoding only supports CUDA ..."), before anything is loaded. The loader builds the class that
config.json's `architectures` names either way (asserted below), and DSparkDraftModel reads no speculative flag
while loading.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.algorithms.dspark import DSPARK
from eagle3.algorithms.dspark.contract import ARCHITECTURE, DSPARK_RELEASES as OUR_DSPARK_RELEASES
from eagle3.algorithms.dspark.layout import validate_sglang, write_sglang
from eagle3.algorithms.dspark.model import DSparkConfig, DSparkDraft, MarkovHeadType
from eagle3.contract.releases import parse_release
from eagle3.errors import ConfigError
from eagle3.model.blocks import init_weights
from eagle3.records.manifest import write_manifest
from eagle3.resolve import load_config
from eagle3.serving.base import launch_spec
from eagle3.serving.sglang import SGLANG
from releases import DSPARK_RELEASES, NO_DSPARK_RELEASES, RELEASES

ROOT = Path(__file__).parents[2]
VOCAB, HIDDEN, GAMMA, RANK, ANCHOR = 40, 32, 3, 8, 7
CONFIDENCE_BUILT = {"SGLANG_RAGGED_VERIFY_MODE": "cap-accept"}  # any mode but static builds the confidence head
UNKNOWN_MARKOV = "markov_head.gate_proj.weight"  # a gated head's tensor, in a vanilla draft
# name -> (the good draft it is made from, what is done to its tensors, the environment it loads in)
FAULTS = {
    "missing-markov": ("vanilla", lambda t: t.pop("markov_head.markov_w2.weight"), {}),
    "unknown-markov": ("vanilla", lambda t: t.update({UNKNOWN_MARKOV: torch.zeros(RANK, HIDDEN + RANK)}), {}),
    "missing-tensor": ("vanilla", lambda t: t.pop("layers.1.self_attn.k_norm.weight"), {}),
    "missing-confidence": ("vanilla", lambda t: t.pop("confidence_head.proj.bias"), CONFIDENCE_BUILT),
}
# each fault: (our validation's error codes, what its message says, what the release's loader does: None = loads it,
# else its message)
EXPECTED = {
    "missing-markov": ({"missing-tensor"}, "leaves it at its initialisation", None),
    "unknown-markov": ({"skipped-tensor"}, "DSpark loader refuses it",
                       f"DSpark unexpected markov weight '{UNKNOWN_MARKOV}'"),
    "missing-tensor": ({"missing-tensor"}, "leaves it at its initialisation", None),
    "missing-confidence": ({"missing-tensor"}, "refuses the draft wherever it builds the confidence head",
                           "DSpark confidence head is enabled but the checkpoint is missing "
                           "['confidence_head.proj.bias']"),
}
# the drafts whose forward is compared: label -> (head type, environment)
FORWARD = {"vanilla": ("vanilla", {}), "confidence": ("vanilla", CONFIDENCE_BUILT), "gated": ("gated", {}),
           "rnn": ("rnn", {})}


def tiny_dspark(head: MarkovHeadType = "vanilla", seed: int = 0, confidence: bool = True) -> DSparkDraft:
    """A 2-layer DSpark draft of gamma 3 on a 40-token target, its heads large enough to change the greedy block."""
    cfg = DSparkConfig(hidden_size=HIDDEN, target_hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=HIDDEN // 4, rms_norm_eps=1e-6,
                       rope_theta=10000.0, max_position_embeddings=256, vocab_size=VOCAB, draft_vocab_size=16,
                       torch_dtype="float32", aux_layers=[0, 1, 2], target_num_hidden_layers=5, target_family="llama",
                       block_size=GAMMA, mask_token_id=VOCAB - 1, markov_rank=RANK, markov_head_type=head,
                       confidence_head=confidence, ce_weight=0.1, l1_weight=0.9, confidence_weight=1.0)
    generator = torch.Generator().manual_seed(seed)
    model = DSparkDraft(cfg, torch.randn(VOCAB, HIDDEN, generator=generator),
                        torch.randn(VOCAB, HIDDEN, generator=generator))
    init_weights(model, seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith(("markov_head.", "confidence_head.")):  # a bias the size of the base logits' spread
                param.copy_(torch.randn(param.shape, generator=generator) * (1.0 if "markov_w" in name else 0.3))
            elif param.dim() == 1:  # norms away from 1, so a norm applied in the wrong place shows
                param.add_(0.3 * torch.randn(param.shape, generator=generator))
    return model.eval()


def ours(model: DSparkDraft, aux: torch.Tensor, ids: torch.Tensor) -> dict:
    """The block at ANCHOR through our draft: stream, base logits, each step's biased logits, tokens, confidence."""
    with torch.no_grad():
        hidden = model.blocks(model.context(aux[None]), ids[ANCHOR].view(1, 1), torch.tensor([[ANCHOR]]))[0, 0]
        tokens = model.draft_block(hidden, int(ids[ANCHOR]))
        prev = torch.tensor([int(ids[ANCHOR])] + tokens[:-1])
        base = hidden @ model.lm_head.T
        step_logits = base + model.markov_head.markov_w2(model.markov_head.latents(prev, hidden))
        confidence = None
        if model.confidence_head is not None:
            confidence = torch.sigmoid(model.confidence_head(hidden, model.markov_head.markov_w1(prev)))
    return {"hidden": hidden, "base": base, "step_logits": step_logits, "drafted": tokens, "confidence": confidence}


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """The good export of each head type, one without a confidence head, one faulty copy per fault, and the data
    manifest they were made for."""
    root = tmp_path_factory.mktemp("dspark-exports")
    models = {head: tiny_dspark(head) for head in ("vanilla", "gated", "rnn")} | {
        "no-confidence": tiny_dspark(confidence=False)}
    paths = {}
    for head, model in models.items():
        (root / f"native-{head}").mkdir()
        DSPARK.write_draft(model.config, model.export_state(), root / f"native-{head}", {})
        paths[head] = write_sglang(root / f"native-{head}", root / head)
    for fault, (good, change, _) in FAULTS.items():
        path = write_sglang(root / f"native-{good}", root / fault)
        tensors = load_file(path / "model.safetensors")
        change(tensors)
        save_file(tensors, path / "model.safetensors")
        paths[fault] = path
    data = root / "data"
    data.mkdir()
    (data / "samples.json").write_text("[]")
    write_manifest(data, kind="dataset", fields={"capture": {"aux_layers": [0, 1, 2]}, "target": {"family": "llama"}})
    return models, paths, data


@pytest.fixture(scope="module")
def inputs(exports):
    models, _, _ = exports
    torch.manual_seed(0)
    aux, ids = torch.randn(12, 3 * HIDDEN), torch.randint(0, VOCAB - 1, (12,))
    vanilla = ours(models["vanilla"], aux, ids)
    # the test's own premise: the Markov head changes the greedy block, so a head ignored shows
    assert models["vanilla"].greedy(vanilla["hidden"]).tolist() != vanilla["drafted"], "pick another seed"
    return aux, ids


@pytest.fixture(scope="module", params=DSPARK_RELEASES)
def loaded(request, run_sglang, exports):
    """Each release's loader on every good and faulty export, in one probe."""
    models, paths, _ = exports
    release = request.param
    faults = {"drafts": {name: str(path) for name, path in paths.items()}, "algorithm": "EAGLE3",
              "environment": {name: env for name, (_, _, env) in FAULTS.items()} | {"confidence": CONFIDENCE_BUILT}}
    faults["drafts"] |= {"confidence": str(paths["vanilla"]), "no-confidence-built": str(paths["no-confidence"])}
    faults["environment"]["no-confidence-built"] = CONFIDENCE_BUILT
    return release, run_sglang(release, "loader", faults)["drafts"]


@pytest.fixture(scope="module", params=DSPARK_RELEASES)
def forward(request, run_sglang, exports, inputs):
    models, paths, _ = exports
    aux, ids = inputs
    # one seed: every tiny draft was made for the same target (embedding and head)
    job = {"drafts": {label: str(paths[head]) for label, (head, _) in FORWARD.items()},
           "environment": {label: env for label, (_, env) in FORWARD.items()}, "anchor": ANCHOR,
           "block_size": GAMMA, "mask_token_id": VOCAB - 1,
           "inputs": {"aux": aux.tolist(), "ids": ids.tolist(), "embed": models["vanilla"].embed_tokens.weight.tolist(),
                      "lm_head": models["vanilla"].lm_head.tolist()}}
    return request.param, run_sglang(request.param, "dflash_forward", job)["drafts"]


@pytest.mark.parametrize("label", ["vanilla", "gated", "rnn", "confidence"])
def test_every_parameter_the_release_builds_is_written_whole_from_our_export(loaded, exports, label):
    release, drafts = loaded
    _, paths, _ = exports
    good = drafts[label]
    assert "error" not in good, f"SGLang {release}: {good.get('error')}"
    unwritten = [name for name, state in good["written"].items() if not state["written"] or state["partial"]]
    assert unwritten == [] and good["written"], f"SGLang {release} leaves {unwritten} unwritten"
    assert good["facts"]["class"] == ARCHITECTURE
    head = {"vanilla": [], "confidence": [], "gated": ["gate_proj.weight", "gate_proj.bias"],
            "rnn": ["joint_proj.weight", "joint_proj.bias"]}[label]
    markov = {f"markov_head.{name}" for name in ["markov_w1.weight", "markov_w2.weight", *head]}
    assert {name for name in good["written"] if name.startswith("markov_head.")} == markov
    assert {"layers.0.self_attn.qkv_proj.weight", "layers.1.mlp.gate_up_proj.weight", "fc.weight",
            "hidden_norm.weight", "norm.weight"} <= set(good["written"])
    tensors = load_file(paths[label if label != "confidence" else "vanilla"] / "model.safetensors")
    assert sorted(good["yielded"]) == sorted(tensors)
    for name in markov:  # whole, unchanged
        assert good["sources"][name] == [{"param": name}], f"SGLang {release}: {name} -> {good['sources'][name]}"
    confidence = {"confidence_head.proj.weight", "confidence_head.proj.bias"}
    if label == "confidence":  # built outside static verify: ours, whole
        assert confidence <= set(good["written"])
        assert all(good["sources"][name] == [{"param": name}] for name in confidence), f"SGLang {release}"
    else:  # static verify (the default): no head, our tensors dropped without a word
        assert not confidence & set(good["written"]), f"SGLang {release} builds the confidence head in static mode"
        assert all(good["sources"][name] == [] for name in confidence), f"SGLang {release}"


@pytest.mark.parametrize("fault", FAULTS)
def test_what_the_loader_does_with_a_fault_our_validation_says(loaded, exports, fault):
    """Our validation refuses every fault, by its code. SGLang refuses an unknown Markov tensor and, where the
    confidence head is built, a missing confidence tensor; it loads a missing Markov or backbone tensor silently,
    left at its initialisation (the sentinel shows it unwritten), which only our validation catches."""
    release, drafts = loaded
    _, paths, data = exports
    codes, says, refusal = EXPECTED[fault]
    report = validate_sglang(paths[fault], release, data / "manifest.json", context_length=128)
    assert {problem.code for problem in report.errors()} == codes, report.to_dict()
    assert all(says in problem.message for problem in report.errors()), report.to_dict()
    result = drafts[fault]
    if refusal is not None:
        assert "error" in result and refusal in result["error"]["message"], f"SGLang {release}: {result}"
        return
    assert "error" not in result, f"SGLang {release} refuses {fault}: {result['error']}"
    missing = {"missing-markov": "markov_head.markov_w2.weight",
               "missing-tensor": "layers.1.self_attn.k_norm.weight"}[fault]
    assert not result["written"][missing]["written"], f"SGLang {release} writes {missing} from nowhere"
    assert all(state["written"] for name, state in result["written"].items() if name != missing)


def test_a_draft_without_a_confidence_head_loads_in_static_verify_only(loaded, exports):
    """SGLang never reads enable_confidence_head: outside static verify it builds the head anyway and refuses a draft
    trained without one (its message's advice, enable_confidence_head=False, changes nothing). Our validation warns."""
    release, drafts = loaded
    _, paths, data = exports
    static, built = drafts["no-confidence"], drafts["no-confidence-built"]
    assert "error" not in static and all(state["written"] for state in static["written"].values()), f"SGLang {release}"
    assert "DSpark confidence head is enabled but the checkpoint is missing" in built["error"]["message"]
    report = validate_sglang(paths["no-confidence"], release, data / "manifest.json", 128)
    assert report.errors() == []
    assert [p.code for p in report.of("warning")] == ["config-field"] and "SGLANG_RAGGED_VERIFY_MODE" in (
        report.of("warning")[0].message)


def test_the_good_exports_validate_clean(exports):
    _, paths, data = exports
    for head in ("vanilla", "gated", "rnn"):
        for release in DSPARK_RELEASES:
            assert validate_sglang(paths[head], release, data / "manifest.json", 128).errors() == [], (head, release)


@pytest.mark.parametrize("label", FORWARD)
def test_the_release_drafts_our_block_from_our_export(forward, exports, inputs, label):
    """One block at P = 7 through SGLang's loaded modules and its own DSPARK heads equals ours: the stream after the
    final norm, the base logits through the target's head, each step's logits with the Markov bias of the token drafted
    before (the anchor first; gated and rnn read the stream, rnn carries its state), the greedy block (0.5.23 also by
    its fused greedy step), and the confidence where the head is built."""
    release, drafts = forward
    models, _, _ = exports
    aux, ids = inputs
    answer = drafts[label]
    assert "hidden" in answer, f"SGLang {release}: {answer['load'].get('error')}"
    expected = ours(models[FORWARD[label][0]], aux, ids)
    close = dict(rtol=1e-4, atol=1e-4, msg=lambda m: f"SGLang {release}, {label}: {m}")
    for key in ("hidden", "base", "step_logits"):
        torch.testing.assert_close(torch.tensor(answer[key]), expected[key], **close)
    assert answer["gamma"] == GAMMA
    assert answer["drafted"] == expected["drafted"], f"SGLang {release}, {label}"
    if "drafted_greedy" in answer:
        assert answer["drafted_greedy"] == expected["drafted"], f"SGLang {release}, {label}: its fused greedy step"
    if label == "confidence":
        torch.testing.assert_close(torch.tensor(answer["confidence"]), expected["confidence"], **close)
    else:
        assert answer["confidence"] is None, f"SGLang {release} builds the confidence head in static mode"


# ---- releases without DSpark -------------------------------------------------------------------------------------

DSPARK_CONFIG = ROOT / "configs" / "tiny-dspark-cpu.yaml"


def dspark_command() -> list[str]:
    """What our launcher writes for the tiny DSpark config, after `-m sglang.launch_server`."""
    command = SGLANG.command(launch_spec(load_config(DSPARK_CONFIG)), "/models/target", "/drafts/candidate")
    return command[command.index("sglang.launch_server") + 1:]


@pytest.fixture(scope="module", params=RELEASES)
def algorithm_answer(request, run_sglang):
    job = {"commands": {"dspark": dspark_command()},
           "construct": {"dspark": {"speculative_algorithm": "DSPARK", "speculative_num_draft_tokens": GAMMA + 1}},
           "algorithms": ["DSPARK"]}
    return request.param, run_sglang(request.param, "server_args", job)


def test_the_releases_with_dspark_are_ours(algorithm_answer):
    """Each release's own SpeculativeAlgorithm knows DSPARK exactly where our contract says it serves it."""
    release, answer = algorithm_answer
    known = answer["algorithms"]["DSPARK"] == "DSPARK"
    assert known == (release in DSPARK_RELEASES) == (parse_release(release) in OUR_DSPARK_RELEASES), (
        f"SGLang {release}: SpeculativeAlgorithm.from_string('DSPARK') -> {answer['algorithms']['DSPARK']}")


def test_a_release_without_dspark_refuses_the_algorithm_in_its_own_server_args(algorithm_answer):
    """0.5.11's parser has a closed list of algorithms; 0.5.12 and 0.5.13 parse anything but their ServerArgs refuse
    the name. (0.5.11's ServerArgs built in Python still accepts it; its scheduler's from_string refuses.)"""
    release, answer = algorithm_answer
    if release in DSPARK_RELEASES:
        # the CPU refuses DSPARK for the device, not the name (why the probes above name EAGLE3)
        assert "DSpark speculative decoding only supports CUDA" in answer["constructed"]["dspark"]["error"]
        return
    parsed, constructed = answer["parsed"]["dspark"], answer["constructed"]["dspark"]
    assert "Unknown speculative algorithm name: DSPARK" in answer["algorithms"]["DSPARK"]["error"]
    if "error" in parsed:
        assert "invalid choice: 'DSPARK'" in parsed["error"], f"SGLang {release}: {parsed['error']}"
    else:
        assert parsed["speculative_algorithm"] == "DSPARK"
        assert "Unknown speculative algorithm name: DSPARK" in constructed["error"], f"SGLang {release}: {constructed}"
    assert ("error" in parsed) == (release == "0.5.11"), f"SGLang {release}'s parser: {parsed}"


@pytest.mark.parametrize("release", NO_DSPARK_RELEASES)
def test_our_config_refuses_a_dspark_draft_served_by_a_release_without_it_in_one_line(release):
    with pytest.raises(ConfigError) as refused:
        load_config(DSPARK_CONFIG, [f"serving.release={release}"])
    message = str(refused.value)
    assert f"SGLang {release} has no DSPARK" in message and "\n" not in message.strip(), message
