"""The promotion gate as a table: each row is one situation and the rules it must trip."""

import pytest

from eagle3.config.deployment import GateSection
from eagle3.registry.gate import Metrics, SuiteFigures, decide

GATE = GateSection(min_accept_rate=0.25, production_tolerance=0.05, sim_serve_tolerance=0.10)
FAST = {"speedup": 1.4, "throughput": "steps 3, topk 4, draft tokens 8, 4 concurrent, temperature 0.0: 140.0 vs 100.0 "
        "output tokens/s"}
GOOD = Metrics(accept_length=2.4, accept_rate=0.47, simulated_accept_length=2.45, **FAST)


@pytest.mark.parametrize(
    ("candidate", "production", "rules"),
    [
        (GOOD, None, []),  # a first deployment that clears every floor
        (GOOD, Metrics(2.45, 0.48), []),  # within 5 % of production
        (GOOD, Metrics(2.6, 0.53), ["regression"]),  # 2.4 < 2.6 x 0.95 = 2.47
        (Metrics(1.05, 0.02, 1.06), None, ["near-baseline"]),  # the 0.20-style disaster, caught on first deploy
        (Metrics(1.05, 0.02, 2.4), Metrics(2.0, 0.33), ["near-baseline", "regression", "train-serve-mismatch"]),
        (Metrics(2.4, 0.47, 2.45, lost_requests=3), None, ["lost-requests"]),
        (Metrics(None, None, 2.4), None, ["no-speculation"]),
        (Metrics(2.0, 0.33, 2.5), None, ["train-serve-mismatch"]),  # 20 % short of the simulator
        (Metrics(2.4, 0.47, 2.45, speedup=0.93, throughput="..."), None, ["throughput"]),  # accepted, yet slower
    ],
)
def test_gate_rules(candidate, production, rules):
    decision = decide(candidate, production, GATE, diagnosis={"failed": ["d2t encoding (offsets)"]})
    assert [r.rule for r in decision.reasons] == rules
    assert decision.promote == (rules == [])
    assert (decision.diagnosis is not None) == ("train-serve-mismatch" in rules)


def test_reasons_name_the_numbers():
    decision = decide(Metrics(1.05, 0.02, 1.06), Metrics(2.6, 0.53), GATE)
    text = decision.summary()
    assert text.startswith("reject:") and "0.020 is below the floor 0.250" in text and "2.470" in text
    assert decide(GOOD, None, GATE).summary() == ("promote: every gate rule passed; speedup 1.40x over the no-draft "
                                                  f"server ({FAST['throughput']})")


def test_the_throughput_rule_names_the_speedup_and_the_bar():
    slow = Metrics(2.4, 0.47, 2.45, speedup=1.12, throughput=FAST["throughput"])
    decision = decide(slow, None, GateSection(min_speedup=1.5))
    assert not decision.promote and [r.rule for r in decision.reasons] == ["throughput"]
    message = decision.reasons[0].message
    assert "speedup 1.12x" in message and "140.0 vs 100.0 output tokens/s" in message and "min_speedup 1.50" in message
    assert decision.summary().count("speedup 1.12x") == 1  # the reason says it; the summary does not repeat it
    assert decide(slow, None, GateSection(min_speedup=1.1)).promote


def test_an_unmeasured_speedup_is_a_note_not_a_rejection():
    unmeasured = Metrics(2.4, 0.47, 2.45)
    decision = decide(unmeasured, None, GATE)
    assert decision.promote and "throughput not measured" in decision.notes[0]
    assert decide(unmeasured, None, GateSection(min_speedup=0.0)).notes == []  # no throughput rule: nothing to say


CHAT, CODE = "a" * 64, "b" * 64  # the suites' requests by sha256


def suites(chat: float, code: float, code_sha: str = CODE, code_steps: int = 400, informational: bool = False):
    return (SuiteFigures("mtbench", chat, 400, CHAT), SuiteFigures("code", code, code_steps, code_sha, informational))


def test_a_gain_on_one_suite_does_not_buy_a_loss_on_another():
    """Overall the candidate is better (2.9 vs 2.7), but it lost 10 % on code: rejected, naming the suite, both
    figures and the requests' sha256."""
    production = Metrics(2.7, 0.57, suites=suites(2.4, 3.0))
    candidate = Metrics(2.9, 0.63, 2.9, suites=suites(3.1, 2.7), **FAST)
    decision = decide(candidate, production, GATE)
    assert not decision.promote and [r.rule for r in decision.reasons] == ["regression"]
    message = decision.reasons[0].message
    assert message.startswith("suite code: accept length 2.700 is below production's 3.000") and CODE in message
    assert "mtbench" not in decision.summary()
    within = Metrics(2.9, 0.63, 2.9, suites=suites(3.1, 2.9), **FAST)  # 2.9 >= 3.0 x 0.95
    assert decide(within, production, GATE).promote


def test_suites_compare_only_over_the_same_requests_and_informational_ones_never_gate():
    production = Metrics(2.7, 0.57, suites=suites(2.4, 3.0))
    other_requests = Metrics(2.9, 0.63, 2.9, suites=suites(3.1, 2.0, code_sha="c" * 64), **FAST)
    decision = decide(other_requests, production, GATE)
    assert decision.promote and f"suite code: production has no figure on these requests (sha256 {'c' * 64})" in \
        decision.notes[0]
    informational = Metrics(2.9, 0.63, 2.9, suites=suites(3.1, 2.0, informational=True), **FAST)
    assert decide(informational, production, GATE).promote


def test_a_suite_with_too_few_verify_steps_is_not_judged_a_pass():
    thin = Metrics(2.9, 0.63, 2.9, suites=suites(3.1, 3.5, code_steps=12), **FAST)
    decision = decide(thin, None, GATE)
    assert not decision.promote and [r.rule for r in decision.reasons] == ["too-few-verify-steps"]
    assert decision.reasons[0].message.startswith("suite code: 12 verify steps, fewer than gate.min_verify_steps 20")
    assert decide(thin, None, GateSection(min_verify_steps=10, min_speedup=1.0)).promote
    assert decide(Metrics(2.9, 0.63, 2.9, suites=suites(3.1, 3.5, code_steps=12, informational=True), **FAST),
                  None, GATE).promote
