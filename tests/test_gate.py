"""The promotion gate as a table: each row is one situation and the rules it must trip."""

import pytest

from eagle3.config.sections import GateSection
from eagle3.registry.gate import Metrics, decide

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
