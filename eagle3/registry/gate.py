"""The promotion gate: a pure function of the candidate's metrics, production's (if any) and the gate
config. A candidate is promoted only when every rule passes; each failed rule is a named reason.

Rules (DESIGN §3, "Promotion and rollback"), all applying to a first deployment except the comparison
with production:
- near-baseline: the acceptance rate is below `gate.min_accept_rate`;
- regression: the accept length is below production's x (1 - production_tolerance);
- train-serve mismatch: simulated and served accept lengths differ by more than sim_serve_tolerance
  (the diagnosis, when given, is attached to the decision);
- lost requests: the benchmark lost any request, so its numbers cannot be trusted;
- data quality: the draft was trained on data that failed its quality check (eagle3.data.quality). A problem
  waived on purpose (data.quality.waive) does not reject; the decision carries a note that says so;
- throughput: the output tokens/s of the serving shape production would get (the sweep's choice), over the no-draft
  server's at the production concurrency, is below `gate.min_speedup`. Not measured (no baseline, no sweep): a note.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from eagle3.config.sections import GateSection
from eagle3.errors import Eagle3Error


@dataclass(frozen=True)
class Metrics:
    accept_length: float | None  # served: Σ completion / Σ verify steps; None without a draft
    accept_rate: float | None
    simulated_accept_length: float | None = None
    lost_requests: int = 0
    data_problems: tuple[dict, ...] = ()  # the training data's quality problems: {code, message, waived}
    speedup: float | None = None  # output tokens/s over the no-draft server's, as production would be served
    throughput: str = ""  # where the speedup was measured: shape, concurrency, tokens/s


@dataclass(frozen=True)
class Reason:
    rule: str
    message: str


@dataclass
class Decision:
    promote: bool
    reasons: list[Reason] = field(default_factory=list)  # why not, when rejected
    diagnosis: dict | None = None
    notes: list[str] = field(default_factory=list)  # what passed only because someone waived a check
    measured: str = ""  # the speedup the decision saw, unless a throughput reason already states it

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        notes = "".join(f" (note: {note})" for note in self.notes)
        measured = f"; {self.measured}" if self.measured else ""
        if self.promote:
            return "promote: every gate rule passed" + measured + notes
        text = "reject: " + "; ".join(f"{r.rule}: {r.message}" for r in self.reasons)
        failed = (self.diagnosis or {}).get("failed")
        return (text + (f"; likely cause (train-serve checklist): {', '.join(failed)}" if failed else "") + measured
                + notes)


def decide(candidate: Metrics, production: Metrics | None, gate: GateSection, diagnosis: dict | None = None) -> Decision:
    reasons = []
    if candidate.lost_requests:
        reasons.append(Reason("lost-requests", f"the benchmark lost {candidate.lost_requests} request(s)"))
    if candidate.accept_length is None or candidate.accept_rate is None:
        reasons.append(Reason("no-speculation", "the served run reported no speculative decoding (no spec_* metrics)"))
    elif candidate.accept_rate < gate.min_accept_rate:
        reasons.append(Reason(
            "near-baseline",
            f"acceptance rate {candidate.accept_rate:.3f} is below the floor {gate.min_accept_rate:.3f} "
            f"(accept length {candidate.accept_length:.3f})",
        ))
    if production is not None and production.accept_length and candidate.accept_length is not None:
        floor = production.accept_length * (1 - gate.production_tolerance)
        if candidate.accept_length < floor:
            reasons.append(Reason(
                "regression",
                f"accept length {candidate.accept_length:.3f} is below production's {production.accept_length:.3f} "
                f"x (1 - {gate.production_tolerance}) = {floor:.3f}",
            ))
    simulated, served = candidate.simulated_accept_length, candidate.accept_length
    if simulated and served is not None and abs(served - simulated) / simulated > gate.sim_serve_tolerance:
        reasons.append(Reason(
            "train-serve-mismatch",
            f"served accept length {served:.3f} differs from the simulated {simulated:.3f} by more than "
            f"{gate.sim_serve_tolerance:.0%}: see the diagnosis",
        ))
    failed = [p["message"] for p in candidate.data_problems if not p["waived"]]
    if failed:
        reasons.append(Reason("data-quality", "the draft was trained on data that failed its quality check: "
                              + "; ".join(failed)))
    notes = [f"data quality check {p['code']} waived on purpose (data.quality.waive): {p['message']}"
             for p in candidate.data_problems if p["waived"]]
    measured = ""
    if candidate.speedup is None and gate.min_speedup:
        notes.append("throughput not measured (benchmark.baseline false and no sweep): gate.min_speedup not applied")
    elif candidate.speedup is not None:
        measured = f"speedup {candidate.speedup:.2f}x over the no-draft server ({candidate.throughput})"
        if candidate.speedup < gate.min_speedup:
            reasons.append(Reason("throughput", f"{measured} is below gate.min_speedup {gate.min_speedup:.2f}: the "
                                  "draft would slow production down"))
            measured = ""  # the reason states it: the summary and the decision report say it once
    mismatch = any(r.rule == "train-serve-mismatch" for r in reasons)
    return Decision(promote=not reasons, reasons=reasons, diagnosis=diagnosis if mismatch else None, notes=notes,
                    measured=measured)


def throughput_text(chosen: dict) -> str:
    """Where a speedup was measured: {label, concurrency, temperature, output_tokens_per_s,
    baseline_output_tokens_per_s, speedup}; "" when it was not."""
    if chosen.get("speedup") is None:
        return ""
    return (f"{chosen['label']}, {chosen['concurrency']} concurrent, temperature {chosen['temperature']}: "
            f"{chosen['output_tokens_per_s']:.1f} vs {chosen['baseline_output_tokens_per_s']:.1f} output tokens/s")


class GateRejected(Eagle3Error):
    """The candidate failed the gate (or production failed its check after a promotion): roll back."""

    def __init__(self, decision: Decision):
        super().__init__(decision.summary())
        self.decision = decision
