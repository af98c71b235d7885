"""The `sglang` feature backend (eagle3/runtime/sglang_features.py) on SGLang 0.5.23's own model runner, on the CPU
(inside/features.py), against the `transformers` backend on the same target and token rows."""

from __future__ import annotations

import pytest
import torch

from eagle3.runtime import sglang_features
from eagle3.runtime.features import TransformersFeatures, pad_rows
from eagle3.errors import Eagle3Error

RELEASE = "0.5.23"  # the one release the backend supports
AUX_LAYERS = [0, 1, 2]  # our ids on the 4-layer micro target (SGLang captures below layer n - 1 only)
LENGTHS = (7, 2, 5, 1, 4)  # rows of different lengths in one batch, a one-token row among them
SLICES = {"all": None, "middle": [1, 3]}
# Both backends compute the same float32 math on the CPU, in a different order (SGLang fuses q/k/v and gate/up into
# one matmul each, runs its own RMSNorm and torch-native attention): only rounding separates them. Measured: under
# 2e-6 with |values| up to ~5. A wrong layer or position differs by O(0.1-1), which the neighbour-layer test shows.
ATOL = 1e-4


def token_rows() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(6, 512, (n,), generator=generator).tolist() for n in LENGTHS]  # ids past the specials


@pytest.fixture(scope="module")
def sglang_run(micro_target, run_sglang, tmp_path_factory):
    """(SGLang's answer, {slice label: {"aux", "last"}}) for the rows."""
    out = tmp_path_factory.mktemp("features") / "features.pt"
    job = {"target": str(micro_target), "family": "llama", "num_hidden_layers": 4, "aux_layers": AUX_LAYERS,
           "rows": token_rows(), "slices": SLICES, "out": str(out)}
    answer = run_sglang(RELEASE, "features", job)
    return answer, torch.load(out)


@pytest.fixture(scope="module")
def reference(micro_target):
    backend = TransformersFeatures(str(micro_target), AUX_LAYERS, "post_norm", torch.device("cpu"))
    yield backend
    backend.close()


def batch():
    rows = token_rows()
    return pad_rows(rows, [f"row{i}" for i in range(len(rows))])


def worst_difference(ours: torch.Tensor, theirs: torch.Tensor, lengths: torch.Tensor) -> float:
    """Largest |difference| over the real positions of each row (padding is unspecified)."""
    return max(float((ours[i, :n] - theirs[i, :n]).abs().max()) for i, n in enumerate(lengths) if n)


@pytest.mark.parametrize("label", SLICES)
def test_sglang_features_equal_the_transformers_features(sglang_run, reference, label):
    answer, computed = sglang_run
    assert answer["release"] == RELEASE
    rows = slice(None) if SLICES[label] is None else slice(*SLICES[label])
    expected = reference.features(batch(), rows)
    lengths = batch().lengths[rows]
    got = computed[label]
    for kind in ("aux", "last"):
        ours, theirs = getattr(expected, kind), got[kind]
        assert theirs.shape == ours.shape, f"{label} {kind}: SGLang {tuple(theirs.shape)}, ours {tuple(ours.shape)}"
        assert theirs.dtype == torch.float32 and bool(torch.isfinite(theirs).all())
        difference = worst_difference(ours, theirs, lengths)
        print(f"{label} {kind}: max |sglang - transformers| = {difference:.3g}")
        assert difference <= ATOL, f"{label} {kind}: SGLang differs from transformers by {difference:.3g}"


def test_the_kv_cache_is_given_back_after_each_batch(sglang_run):
    answer, _ = sglang_run
    assert answer["free_kv_after"] == answer["free_kv_before"] > 0


def test_the_tolerance_tells_neighbouring_layers_apart(sglang_run, micro_target):
    """Features of the layers one later than asked differ far beyond ATOL: the comparison above pins the layers."""
    _, computed = sglang_run
    shifted = TransformersFeatures(str(micro_target), [k + 1 for k in AUX_LAYERS], "post_norm", torch.device("cpu"))
    try:
        expected = shifted.features(batch())
    finally:
        shifted.close()
    assert worst_difference(expected.aux, computed["all"]["aux"], batch().lengths) > 100 * ATOL


def test_pre_norm_is_refused_with_what_to_use_instead(micro_target):
    with pytest.raises(Eagle3Error, match="post_norm"):
        sglang_features.SGLangFeatures(str(micro_target), "llama", 4, AUX_LAYERS, "pre_norm", 0, 1, "cpu", {})


def test_settings_that_split_the_batch_over_ranks_are_refused(micro_target):
    with pytest.raises(Eagle3Error, match="enable_dp_attention"):
        sglang_features.SGLangFeatures(str(micro_target), "llama", 4, AUX_LAYERS, "post_norm", 0, 1, "cpu",
                                       {"enable_dp_attention": True})
