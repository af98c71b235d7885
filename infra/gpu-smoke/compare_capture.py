"""Compare two captured datasets of the same samples: ids and masks equal, hidden states close."""

import sys

import torch

from eagle3.data.shards import read_dataset


def main(reference: str, candidate: str) -> int:
    expected = {s.id: s for s in read_dataset(reference)}
    worst = {"aux_hidden": 0.0, "last_hidden": 0.0}
    for sample in read_dataset(candidate):
        ref = expected.pop(sample.id)
        assert torch.equal(ref.input_ids, sample.input_ids) and torch.equal(ref.loss_mask, sample.loss_mask), sample.id
        for kind in worst:
            a, b = getattr(ref, kind).float(), getattr(sample, kind).float()
            assert a.shape == b.shape, f"{sample.id} {kind}: {tuple(a.shape)} vs {tuple(b.shape)}"
            worst[kind] = max(worst[kind], float(((a - b).norm(dim=-1) / a.norm(dim=-1).clamp_min(1e-6)).max()))
    assert not expected, f"samples missing from {candidate}: {sorted(expected)[:5]}"
    print(f"max relative row error: aux {worst['aux_hidden']:.4f}, last {worst['last_hidden']:.4f}")
    ok = max(worst.values()) < 0.05
    print("capture matches" if ok else "capture DIFFERS: check the aux ids and the release rules")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
