"""The drafts a run trains side by side (its own and its contenders', on the same data, measured on the same requests)
and the one production gets: the fastest by served speedup in its chosen shape among those the gate passes, under the
gate's rules (per suite included); the fastest of all when the gate passes none, so that the gate's rejection names
why. Recorded in run.dir/bench/contenders.json (docs/algorithms.md, "Contenders")."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eagle3.config import PipelineConfig
from eagle3.deployment.promotion import Candidate
from eagle3.deployment.suites import column, steps_topk_tokens
from eagle3.fsutil import atomic_write_json
from eagle3.registry.gate import Decision

RULE = "the fastest by served speedup in its chosen shape, among the drafts every gate rule passes"


@dataclass(frozen=True)
class Contender:
    """One draft of the run: its label (its algorithm, or the contender's name), its config and its measurement."""
    label: str
    config: PipelineConfig
    candidate: Candidate  # its serving shape chosen


def speedup(contender: Contender) -> float:
    return (contender.candidate.chosen or {}).get("speedup") or 0.0  # none measured: never faster than one that was


def pick(contenders: list[Contender], decisions: list[Decision]) -> int:
    """The index of the draft production gets (the first of equals: the run's own)."""
    passing = [i for i, decision in enumerate(decisions) if decision.promote] or range(len(contenders))
    return max(passing, key=lambda i: speedup(contenders[i]))


def contender_row(contender: Contender, decision: Decision) -> dict:
    candidate, chosen = contender.candidate, contender.candidate.chosen or {}
    return {"label": contender.label, "algorithm": contender.config.draft.algorithm,
            "run_dir": str(contender.config.run.dir), "version_fingerprint": candidate.fingerprint,
            "simulated_accept_length": candidate.simulated.get("accept_length"),
            "served_accept_length": candidate.served.get("accept_length"),
            "chosen_shape": chosen.get("shape"), "output_tokens_per_s": chosen.get("output_tokens_per_s"),
            "baseline_output_tokens_per_s": chosen.get("baseline_output_tokens_per_s"), "speedup": chosen.get("speedup"),
            "gate": decision.summary(), "passes": decision.promote}


def contenders_record(contenders: list[Contender], decisions: list[Decision], chosen: int) -> dict:
    """Each draft's figures and gate verdict, which one production gets, and a suites table with a column per draft
    (accept length per suite in its chosen shape, at the production concurrency)."""
    columns = []
    for contender in contenders:
        chosen_shape = contender.candidate.chosen or {}
        shape = steps_topk_tokens(chosen_shape["shape"]) if chosen_shape.get("shape") else "-"
        columns.append(column(f"{contender.label} {shape} served", chosen_shape.get("suites")
                              or contender.candidate.served.get("suites"), chosen_shape.get("output_tokens_per_s")))
    return {"rule": RULE, "chosen": contenders[chosen].label,
            "drafts": [contender_row(c, d) for c, d in zip(contenders, decisions)], "columns": columns}


def write_contenders(record: dict | None, out: Path) -> Path:
    """The record at `out`; None removes an earlier run's, so a run without contenders is never reported with them."""
    if record is None:
        out.unlink(missing_ok=True)
    else:
        atomic_write_json(out, record)
    return out


def contenders_text(record: dict) -> list[str]:
    """One line per draft, the chosen one marked: for the log and `eagle3 run`'s summary (the suites table of
    record["columns"] follows them there: eagle3.report.suites_text)."""
    lines = [f"drafts side by side ({record['rule']}):"]
    for row in record["drafts"]:
        speed = "-" if row["speedup"] is None else f"{row['speedup']:.2f}x"
        shape = steps_topk_tokens(row["chosen_shape"]) if row["chosen_shape"] else "-"
        served = "-" if row["served_accept_length"] is None else f"{row['served_accept_length']:.3f}"
        mark = "  <- production gets it" if row["label"] == record["chosen"] else ""
        lines.append(f"  {row['label']} ({row['algorithm']}): served accept length {served}, {shape} at {speed} the "
                     f"no-draft server; gate: {row['gate']}{mark}")
    return lines
