"""The promotion gate: a pure function of the candidate's metrics, production's (if any) and the gate
config. A candidate is promoted only when every rule passes; each failed rule is a named reason.

Rules (docs/contracts.md, "Promotion and rollback"), all applying to a first deployment except the comparison
with production:
- near-baseline: the acceptance rate is below `gate.min_accept_rate`;
- regression: on any gating suite (benchmark.suites), the accept length is below production's on the same requests
  (their sha256 agree) x (1 - production_tolerance); a suite production has no figure for is named in a note. Figures
  without suites (a version published before them) are compared as one whole;
- too few verify steps: a gating suite measured over fewer than gate.min_verify_steps verify steps cannot be judged;
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

from eagle3.config.deployment import GateSection
from eagle3.errors import Eagle3Error


@dataclass(frozen=True)
class SuiteFigures:
    name: str
    accept_length: float | None
    verify_ct: int
    sha256: str  # the suite's requests (eagle3.bench.client.suite_digests): figures compare only over the same ones
    informational: bool = False  # reported, never gating


def suite_figures(suites: dict | None) -> tuple[SuiteFigures, ...]:
    """A measurement's `suites` ({name: {accept_length, verify_ct, sha256, informational, ...}}) as the gate reads
    them."""
    return tuple(SuiteFigures(name, f.get("accept_length"), f.get("verify_ct") or 0, f.get("sha256") or "",
                              bool(f.get("informational"))) for name, f in (suites or {}).items())


@dataclass(frozen=True)
class Metrics:
    accept_length: float | None  # served: Σ completion / Σ verify steps; None without a draft
    accept_rate: float | None
    simulated_accept_length: float | None = None
    lost_requests: int = 0
    data_problems: tuple[dict, ...] = ()  # the training data's quality problems: {code, message, waived}
    speedup: float | None = None  # output tokens/s over the no-draft server's, as production would be served
    throughput: str = ""  # where the speedup was measured: shape, concurrency, tokens/s
    suites: tuple[SuiteFigures, ...] = ()  # per benchmark suite; () for figures published before suites


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
    notes = []
    if production is not None:
        reasons += regressions(candidate, production, gate, notes)
    reasons += [Reason("too-few-verify-steps", f"suite {s.name}: {s.verify_ct} verify steps, fewer than "
                       f"gate.min_verify_steps {gate.min_verify_steps}: too few to judge (give it more prompts, "
                       "benchmark.suites[].num_prompts, or mark it informational)")
                for s in candidate.suites if not s.informational and s.verify_ct < gate.min_verify_steps]
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
    notes += [f"data quality check {p['code']} waived on purpose (data.quality.waive): {p['message']}"
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


def regressions(candidate: Metrics, production: Metrics, gate: GateSection, notes: list[str]) -> list[Reason]:
    """Suite by suite over the same requests; as one whole when either side has no suite figures. A gating suite
    production has no figure for is named in `notes`."""
    tolerance = gate.production_tolerance
    if not (candidate.suites and production.suites):
        return regression(None, candidate.accept_length, production.accept_length, tolerance, "")
    theirs, reasons = {s.name: s for s in production.suites}, []
    for mine in candidate.suites:
        other = theirs.get(mine.name)
        if mine.informational or mine.accept_length is None:
            continue
        if other is None or other.sha256 != mine.sha256 or other.accept_length is None:
            notes.append(f"suite {mine.name}: production has no figure on these requests (sha256 {mine.sha256}): "
                         "not compared")
            continue
        reasons += regression(mine.name, mine.accept_length, other.accept_length, tolerance, mine.sha256)
    return reasons


def regression(suite: str | None, length: float | None, theirs: float | None, tolerance: float,
               sha256: str) -> list[Reason]:
    if not theirs or length is None or length >= theirs * (1 - tolerance):
        return []
    where = f"suite {suite}: " if suite else ""
    same = f" on the same requests (sha256 {sha256})" if sha256 else ""
    return [Reason("regression", f"{where}accept length {length:.3f} is below production's {theirs:.3f} x (1 - "
                   f"{tolerance}) = {theirs * (1 - tolerance):.3f}{same}")]


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
