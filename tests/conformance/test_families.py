"""Each family's own SGLang model file run whole on the CPU (0.5.23's model runner, inside/features.py) on a tiny
target of that family, against the features the data stage trains on (transformers' hidden states). Where the aux-id
table says the release records the residual stream, the two agree to rounding; where it says the loop records
something else (Gemma 3 from 0.5.17), the run shows what: the previous layer's feed-forward branch, exactly.
Every release's capture rule and loop (with stand-in layers) is test_aux_ids.py's.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from eagle3.runtime.features import TransformersFeatures, pad_rows
from eagle3.contract import engines
from eagle3.contract.releases import parse_release
from family_targets import AUX_LAYERS, FAMILIES, NUM_LAYERS, VOCAB, build_family_target

RELEASE = "0.5.23"  # the release the model-runner backend supports (sglang_features.SUPPORTED_RELEASES)
LENGTHS = (7, 2, 5)
ATOL = 1e-4  # float32 in both, another order of operations: measured under 1e-6 (test_features.py)


def token_rows() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(6, VOCAB, (n,), generator=generator).tolist() for n in LENGTHS]


def batch():
    rows = token_rows()
    return pad_rows(rows, [f"row{i}" for i in range(len(rows))])


def worst_difference(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return max(float((ours[i, :n] - theirs[i, :n]).abs().max()) for i, n in enumerate(batch().lengths))


@pytest.fixture(scope="module", params=FAMILIES)
def family_run(request, run_sglang, tmp_path_factory):
    """(family, target directory, SGLang's {"aux", "last"}) for the tiny target of one family."""
    family = request.param
    root = tmp_path_factory.mktemp(family)
    target = build_family_target(root / "target", family)
    job = {"target": str(target), "family": family, "num_hidden_layers": NUM_LAYERS, "aux_layers": AUX_LAYERS,
           "rows": token_rows(), "slices": {"all": None}, "out": str(root / "features.pt")}
    answer = run_sglang(RELEASE, "features", job)
    assert answer["release"] == RELEASE
    return family, target, torch.load(root / "features.pt")["all"]


def transformers_features(target):
    backend = TransformersFeatures(str(target), AUX_LAYERS, "post_norm", torch.device("cpu"))
    try:
        return backend.features(batch())
    finally:
        backend.close()


def branch_outputs(target) -> torch.Tensor:
    """[B, T, n_aux * H]: each aux layer's feed-forward branch after its post-feed-forward norm, the value Gemma 3's
    layer returns as hidden_states beside the residual."""
    model = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    captured = {}
    hooks = [model.model.layers[k].post_feedforward_layernorm.register_forward_hook(
        lambda module, args, output, k=k: captured.__setitem__(k, output)) for k in AUX_LAYERS]
    rows = batch()
    mask = torch.arange(rows.input_ids.shape[1]) < rows.lengths[:, None]  # [B, T]: right padding never attended
    with torch.no_grad():
        model(input_ids=rows.input_ids, attention_mask=mask.long())
    for hook in hooks:
        hook.remove()
    return torch.cat([captured[k] for k in AUX_LAYERS], dim=-1)


def test_the_last_hidden_state_agrees_on_every_family(family_run):
    """The model file and transformers compute the same network: the final-norm output matches whatever the aux."""
    family, target, sglang = family_run
    difference = worst_difference(transformers_features(target).last, sglang["last"])
    print(f"{family} last: max |sglang - transformers| = {difference:.3g}")
    assert difference <= ATOL


def test_the_aux_states_are_what_the_table_says_the_release_records(family_run):
    family, target, sglang = family_run
    rule = engines.aux_id_rule(family, parse_release(RELEASE))
    assert rule is not None, f"{family} on {RELEASE} is not in the aux-id table"
    trained_on = transformers_features(target).aux
    difference = worst_difference(trained_on, sglang["aux"])
    print(f"{family} aux: max |sglang - transformers| = {difference:.3g} (table: {rule.records})")
    if rule.records == engines.RESIDUAL_STREAM:
        assert difference <= ATOL
        assert engines.served_features_problem(family, RELEASE) is None
        return
    assert rule.records == engines.BRANCH_ONLY
    assert difference > 100 * ATOL, f"{family} on {RELEASE} captures what training reads; the table says otherwise"
    branch = worst_difference(branch_outputs(target), sglang["aux"])
    print(f"{family} aux: max |sglang - feed-forward branch| = {branch:.3g}")
    assert branch <= ATOL
    assert engines.served_features_problem(family, RELEASE) is not None

