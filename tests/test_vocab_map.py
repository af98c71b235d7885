import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eagle3.errors import UnreadableInput
from eagle3.draft.vocab_map import (
    VocabMap,
    VocabMapError,
    analyze_d2t,
    build_vocab_map,
    check_invariants,
    load_vocab_map,
    read_stats,
    save_vocab_map,
)


@st.composite
def counts_and_size(draw):
    target_vocab = draw(st.integers(1, 200))
    counts = draw(st.lists(st.integers(0, 6), min_size=target_vocab, max_size=target_vocab))
    if sum(counts) == 0:
        counts[draw(st.integers(0, target_vocab - 1))] = 1
    return counts, draw(st.integers(1, target_vocab))  # a list: torch stays out of the draw (Hypothesis watches
    # the random module's state there, and torch's first use may import modules that touch it)


@settings(max_examples=300, deadline=None)
@given(counts_and_size())
def test_build_obeys_the_contract(case):
    counts, k = torch.tensor(case[0], dtype=torch.int64), case[1]
    vocab_map, stats = build_vocab_map(counts, k)
    d2t, t2d = vocab_map.d2t, vocab_map.t2d
    assert d2t.dtype == torch.int64 and d2t.shape == (k,)
    assert t2d.dtype == torch.bool and t2d.shape == counts.shape and int(t2d.sum()) == k
    ids = vocab_map.target_ids()
    assert torch.equal(ids, torch.nonzero(t2d).flatten())  # i + d2t[i] == t2d.nonzero(), sorted ascending
    assert bool((d2t[1:] >= d2t[:-1]).all())  # offsets of a sorted map never decrease

    # The chosen ids are exactly the top k by (count descending, id ascending); padding = lowest unused ids.
    ranking = sorted(range(len(counts)), key=lambda i: (-int(counts[i]), i))
    assert set(ids.tolist()) == set(ranking[:k])
    seen = int((counts > 0).sum())
    assert stats.padding == max(0, k - seen)
    unseen_chosen = sorted(i for i in ids.tolist() if counts[i] == 0)
    assert unseen_chosen == [i for i in range(len(counts)) if counts[i] == 0][: stats.padding]
    assert stats.counted_tokens == int(counts.sum())
    assert stats.coverage == pytest.approx(int(counts[ids].sum()) / int(counts.sum()))
    assert analyze_d2t(d2t, t2d).encoding == "offsets"


def test_ties_prefer_the_lower_id_and_padding_fills_lowest_unused():
    counts = torch.tensor([0, 5, 0, 5, 2, 5, 0, 0])
    vocab_map, stats = build_vocab_map(counts, 3)
    assert vocab_map.target_ids().tolist() == [1, 3, 5]
    vocab_map, stats = build_vocab_map(counts, 6)
    assert vocab_map.target_ids().tolist() == [0, 1, 2, 3, 4, 5] and stats.padding == 2
    assert vocab_map.d2t.tolist() == [0, 0, 0, 0, 0, 0]


def test_build_rejects_bad_input():
    with pytest.raises(ValueError, match="no tokens were counted"):
        build_vocab_map(torch.zeros(5, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="draft_vocab_size 6"):
        build_vocab_map(torch.ones(5, dtype=torch.int64), 6)


def _map(k=8, vocab=32):
    counts = torch.arange(vocab, 0, -1)
    counts[::3] = 0
    return build_vocab_map(counts, k)


def test_save_and_load_round_trip(tmp_path):
    vocab_map, stats = _map()
    save_vocab_map(vocab_map, tmp_path / "vocab", stats)
    loaded = load_vocab_map(tmp_path / "vocab")
    assert torch.equal(loaded.d2t, vocab_map.d2t) and torch.equal(loaded.t2d, vocab_map.t2d)
    assert read_stats(tmp_path / "vocab") == stats
    assert not [p for p in (tmp_path / "vocab").iterdir() if p.name.endswith(".tmp")]


def test_reads_specforge_pt_and_speculators_npy(tmp_path):
    vocab_map, _ = _map()
    torch.save({"d2t": vocab_map.d2t, "t2d": vocab_map.t2d}, tmp_path / "vocab_mapping.pt")
    assert torch.equal(load_vocab_map(tmp_path / "vocab_mapping.pt").d2t, vocab_map.d2t)
    spec = tmp_path / "speculators"
    spec.mkdir()
    np.save(spec / "d2t-8.npy", vocab_map.d2t.numpy())
    np.save(spec / "t2d-8.npy", vocab_map.t2d.numpy())
    assert torch.equal(load_vocab_map(spec).t2d, vocab_map.t2d)


class Payload:
    """Any class: unpickling it would run code of the file's choosing."""


def test_never_unpickles_arbitrary_objects(tmp_path):
    torch.save({"d2t": torch.zeros(2, dtype=torch.int64), "t2d": Payload()}, tmp_path / "evil.pt")
    with pytest.raises(UnreadableInput, match="refusing to unpickle"):
        load_vocab_map(tmp_path / "evil.pt")


def test_load_refuses_absolute_ids_with_the_evidence(tmp_path):
    vocab_map, _ = _map()
    absolute = {"d2t": vocab_map.target_ids(), "t2d": vocab_map.t2d}
    torch.save(absolute, tmp_path / "abs.pt")
    with pytest.raises(VocabMapError, match="not offsets.*absolute ids"):
        load_vocab_map(tmp_path / "abs.pt")


def test_load_refuses_count_mismatch_and_wrong_dtypes(tmp_path):
    vocab_map, _ = _map()
    t2d = vocab_map.t2d.clone()
    t2d[torch.nonzero(~t2d)[0]] = True
    torch.save({"d2t": vocab_map.d2t, "t2d": t2d}, tmp_path / "count.pt")
    with pytest.raises(VocabMapError, match="t2d has 9 true entries but d2t has 8 rows"):
        load_vocab_map(tmp_path / "count.pt")
    torch.save({"d2t": vocab_map.d2t.to(torch.int32), "t2d": vocab_map.t2d}, tmp_path / "dtype.pt")
    with pytest.raises(VocabMapError, match="d2t must be a 1-D int64"):
        load_vocab_map(tmp_path / "dtype.pt")


def test_unreadable_inputs_name_the_path(tmp_path):
    with pytest.raises(UnreadableInput, match="no such file"):
        load_vocab_map(tmp_path / "nope.safetensors")
    (tmp_path / "corrupt.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(UnreadableInput, match="corrupt.safetensors: cannot read tensors"):
        load_vocab_map(tmp_path / "corrupt.safetensors")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UnreadableInput, match="empty: expected vocab_map.safetensors"):
        load_vocab_map(tmp_path / "empty")


class TestAnalysis:
    """Encoding is judged by t2d agreement, range and the shape of the values, not by monotonicity."""

    def test_absolute_ids_are_caught_by_t2d_even_though_they_increase(self):
        vocab_map, _ = _map()
        analysis = analyze_d2t(vocab_map.target_ids(), vocab_map.t2d)
        assert analysis.encoding == "absolute"
        assert any("d2t itself equals" in e for e in analysis.evidence)

    def test_absolute_ids_without_t2d_are_caught_by_range(self):
        ids = torch.arange(20, 52)  # 32 absolute ids near the top of a 64-token vocabulary
        analysis = analyze_d2t(ids, None, target_vocab_size=64)
        assert analysis.encoding == "absolute" and analysis.offsets_in_range is False

    def test_offsets_without_t2d_are_judged_by_shape(self):
        vocab_map, _ = _map()
        analysis = analyze_d2t(vocab_map.d2t, None, target_vocab_size=32)
        assert analysis.encoding == "offsets" and "pass t2d" in analysis.verdict

    def test_strictly_increasing_in_range_without_t2d_is_unknown(self):
        analysis = analyze_d2t(torch.tensor([0, 2, 5, 9]), None, target_vocab_size=100)
        assert analysis.encoding == "unknown"

    def test_maps_from_different_sources_are_invalid(self):
        vocab_map, _ = _map()
        other, _ = build_vocab_map(torch.arange(32), 8)
        assert analyze_d2t(vocab_map.d2t, other.t2d).encoding == "invalid"

    def test_unsorted_but_consistent_is_offsets(self):
        ids = torch.tensor([4, 1, 9, 7])
        t2d = torch.zeros(12, dtype=torch.bool)
        t2d[ids] = True
        analysis = analyze_d2t(ids - torch.arange(4), t2d)
        assert analysis.encoding == "offsets" and not analysis.offsets_sorted
        check_invariants(VocabMap(d2t=ids - torch.arange(4), t2d=t2d), source="unsorted")  # a warning, not an error

    def test_leading_zeros_and_repeats_are_counted(self):
        d2t = torch.tensor([0, 0, 0, 2, 2, 5])
        analysis = analyze_d2t(d2t)
        assert analysis.leading_zeros == 3 and analysis.unique_values == 3 and analysis.nonzero == 3
        assert analysis.first_mappings[:4] == [(0, 0), (1, 1), (2, 2), (3, 5)]
