"""`eagle3 inspect`: a human diagnosis of a vocab map or a draft checkpoint, in one go.

It answers the questions people ask when debugging a d2t tensor: which encoding is it and why do we
think so, why are there leading zeros, why do values repeat, which target ids do the first and last
draft ids predict, does it agree with t2d, and how much of the data does the draft vocabulary cover.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch

from eagle3.draft.files import CONFIG_FILE
from eagle3.algorithms.eagle3.checkpoint import read_checkpoint
from eagle3.draft.vocab_map import D2TAnalysis, analyze_d2t, read_d2t_t2d, read_stats


def inspect_path(path: Path) -> dict:
    """A JSON-ready description of a vocab map (file or directory) or a checkpoint directory."""
    path = Path(path)
    if path.is_dir() and (path / CONFIG_FILE).exists():
        raw = read_checkpoint(path)
        d2t, t2d = raw.tensors.get("d2t"), raw.tensors.get("t2d")
        return {
            "kind": "checkpoint",
            "path": str(path),
            "layout": raw.layout,
            "tensors": {name: {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")} for name, t in sorted(raw.tensors.items())},
            "vocab": None if d2t is None else describe_vocab(d2t, t2d, raw.config.get("vocab_size"), None),
        }
    d2t, t2d = read_d2t_t2d(path)
    stats = read_stats(path) if path.is_dir() else read_stats(path.parent)
    return {"kind": "vocab_map", "path": str(path), "vocab": describe_vocab(d2t, t2d, None, stats)}


def describe_vocab(d2t: torch.Tensor, t2d: torch.Tensor | None, target_vocab: int | None, stats) -> dict:
    analysis = analyze_d2t(d2t, t2d, target_vocab)
    return {
        "d2t": {"entries": d2t.numel(), "dtype": str(d2t.dtype).removeprefix("torch.")},
        "t2d": None
        if t2d is None
        else {"entries": t2d.numel(), "dtype": str(t2d.dtype).removeprefix("torch."), "true": int(t2d.to(torch.bool).sum())},
        "analysis": asdict(analysis),
        "stats": None if stats is None else asdict(stats),
    }


def render(result: dict) -> str:
    lines = [f"{result['path']}: {result['kind'].replace('_', ' ')}"]
    if result["kind"] == "checkpoint":
        lines.append(f"layout: {result['layout']}; {len(result['tensors'])} tensors")
        for name, info in result["tensors"].items():
            lines.append(f"  {name:48s} {str(info['shape']):>16s} {info['dtype']}")
        if result["vocab"] is None:
            lines.append("no d2t tensor: the draft head predicts the target vocabulary directly")
            return "\n".join(lines)
    lines.extend(render_vocab(result["vocab"]))
    return "\n".join(lines)


def render_vocab(vocab: dict) -> list[str]:
    a = D2TAnalysis(**vocab["analysis"])
    t2d = vocab["t2d"]
    lines = [
        f"d2t: {vocab['d2t']['entries']} entries, {vocab['d2t']['dtype']}"
        + (f"; t2d: {t2d['entries']} entries, {t2d['dtype']}, {t2d['true']} true" if t2d else "; no t2d"),
        f"encoding: {a.encoding.upper()} — {a.verdict}",
        "  what SGLang computes: row i of lm_head predicts target id i + d2t[i] (hot_token_id = d2t + arange)",
        "  evidence:",
        *(f"    - {item}" for item in a.evidence),
    ]
    lines.append(f"non-zero entries: {a.nonzero} of {a.draft_vocab_size}.")
    if a.leading_zeros:
        lines.append(
            f"  the first {a.leading_zeros} entries are 0: draft ids 0..{a.leading_zeros - 1} predict target ids "
            f"0..{a.leading_zeros - 1}, i.e. the lowest target ids (special and byte tokens) are in the draft "
            "vocabulary. That is expected for offsets, not a bug."
        )
    lines.append(f"unique values: {a.unique_values} of {a.draft_vocab_size}.")
    if a.unique_values < a.draft_vocab_size:
        lines.append(
            "  repeats are normal for offsets: d2t[i] = target_id - i stays constant along every run of "
            "consecutive target ids. They do not mean several draft tokens share a target token."
        )
    lines.append(f"first draft ids -> target ids (offsets reading): {_pairs(a.first_mappings)}")
    if a.last_mappings:
        lines.append(f"last draft ids -> target ids (offsets reading): {_pairs(a.last_mappings)}")
    if a.t2d_agreement is None:
        lines.append("t2d agreement: unknown (no t2d beside d2t)")
    else:
        lines.append(f"t2d agreement: {'yes' if a.t2d_agreement else 'NO'} (set of i + d2t[i] vs t2d.nonzero())")
    if a.t2d_agreement and not a.offsets_sorted:
        lines.append("  the target ids are not ascending: still served correctly, but not how this project builds maps")
    stats = vocab["stats"]
    if stats is None:
        lines.append("coverage: unknown (no vocab_stats.json beside the map)")
    else:
        lines.append(
            f"coverage: {stats['coverage']:.2%} of {stats['counted_tokens']:,} counted target tokens are in the draft "
            f"vocabulary; {stats['distinct_ids_seen']:,} distinct ids seen; {stats['padding']} padding ids"
        )
    return lines


def _pairs(items: list[tuple[int, int]]) -> str:
    return ", ".join(f"{draft}->{target}" for draft, target in items)
