"""The production monitor (eagle3.deployment.monitor) against the edge of a production server: request records written
in SGLang's format and /metrics served over HTTP by a small app. Windows from records (per slice, the pipeline's own
requests left out) and from counter deltas (a reset included); insufficient windows never alarm; K low windows in a row
raise one alarm, a second drop during the cool-down none; an unavailable server is logged, not alarmed; the history
lives in the registry's store, S3 included."""

import base64
from datetime import datetime

import pytest
from fastapi import FastAPI

from eagle3.deployment.monitor import Monitor
from eagle3.records.telemetry import UNLABELLED
from eagle3.report import monitor_report
from eagle3.serve.inprocess import serve_in_thread
from helpers import (
    BASELINE, TINY, ProductionEdge, monitor_for, traffic, write_record,
)

T0 = datetime(2026, 11, 30, 12, 0).timestamp()


@pytest.fixture
def production():
    server = ProductionEdge()
    with serve_in_thread(server.app) as (url, _):
        server.port = int(url.rsplit(":", 1)[1])
        yield server


def test_a_window_from_records_counts_users_requests_per_slice(production, tmp_path):
    monitor = monitor_for(None, tmp_path, production.port)
    records = tmp_path / "records"
    write_record(records, T0 - 700, 999, 1, {"app": "chat"})  # before the window
    write_record(records, T0 - 500, 300, 100, {"app": "code"})
    write_record(records, T0 - 400, 100, 80, {"app": "chat"})
    write_record(records, T0 - 300, 40, 20)  # no label
    write_record(records, T0 - 200, 500, 100, {"eagle3": "benchmark"})  # the pipeline's own: not traffic
    window = monitor.run_window(now=T0)
    assert window["source"] == "records" and window["requests"] == 3 and window["verify_steps"] == 200
    assert window["accept_length"] == pytest.approx(440 / 200)
    assert window["output_tokens_per_s"] == pytest.approx(440 / 600)
    assert window["slices"]["code"]["accept_length"] == pytest.approx(3.0)
    assert window["slices"]["chat"]["accept_length"] == pytest.approx(1.25)
    assert window["slices"][UNLABELLED]["requests"] == 1 and "eagle3" not in window["slices"]
    assert window["verdict"] == "low" and window["threshold"] == pytest.approx(BASELINE * 0.85)
    assert "alarm" not in window  # one low window of three
    assert [w["t"] for w in monitor.windows()] == [T0]


def test_metrics_counter_deltas_and_a_restarted_server(production, tmp_path):
    monitor = monitor_for(None, tmp_path, production.port, "monitor.source=metrics", "production.telemetry.metrics=true")
    production.tokens, production.verify_calls = 10_000, 4_000
    first = monitor.run_window(now=T0)
    assert first["verdict"] == "insufficient" and "first /metrics sample" in first["reason"]
    production.tokens, production.verify_calls = 13_000, 5_000
    second = monitor.run_window(now=T0 + 300)
    assert second["accept_length"] == pytest.approx(3.0) and second["verify_steps"] == 1_000
    assert second["output_tokens_per_s"] == pytest.approx(10.0) and second["verdict"] == "ok"
    production.tokens, production.verify_calls = 400, 200  # the server restarted: counting from zero again
    third = monitor.run_window(now=T0 + 600)
    assert third["verify_steps"] == 200 and third["accept_length"] == pytest.approx(2.0)
    assert third["verdict"] == "low" and third["slices"] is None


def test_insufficient_windows_never_alarm_even_when_low(production, tmp_path):
    monitor = monitor_for(None, tmp_path, production.port, "monitor.consecutive=2")
    for i in range(5):
        traffic(tmp_path, T0 + 600 * i, accept=1.2, steps=40)  # very low, but 40 verify steps < 100
        window = monitor.run_window(now=T0 + 600 * (i + 1))
        assert window["verdict"] == "insufficient" and "alarm" not in window
    assert monitor.alarms() == []


def test_k_low_windows_raise_one_alarm_and_a_second_drop_in_the_cool_down_none(section, tmp_path):  # noqa: F811
    with serve_in_thread(ProductionEdge().app) as (url, _):
        monitor = monitor_for(section, tmp_path, int(url.rsplit(":", 1)[1]))
        verdicts = []
        for i, accept in enumerate([2.0, 2.0, 3.0, 2.0, 2.0, 1.0, 2.0, 2.0, 2.0, 2.0, 2.0]):
            steps = 40 if accept == 1.0 else 200  # the 1.0 window is insufficient: it neither counts nor breaks
            traffic(tmp_path, T0 + 600 * i, accept, steps)
            window = monitor.run_window(now=T0 + 600 * (i + 1))
            verdicts.append((window["verdict"], (window.get("alarm") or {}).get("state")))
    assert verdicts == [("low", None), ("low", None), ("ok", None), ("low", None), ("low", None),
                        ("insufficient", None), ("low", "raised"),  # three low in a row, the ok one broke the first
                        ("low", None), ("low", None), ("low", "suppressed"),  # a second drop: in the cool-down
                        ("low", None)]
    alarms = monitor.alarms()
    assert len(alarms) == 1 and alarms[0]["state"] == "raised" and alarms[0]["version"] == "v1"
    assert [w["accept_length"] for w in alarms[0]["windows"]] == pytest.approx([2.0, 2.0, 2.0])
    assert alarms[0]["baseline"]["accept_length"] == BASELINE and alarms[0]["slices"]["code"]["verify_steps"] == 200
    suppressed = monitor.windows()[9]["alarm"]
    assert "within monitor.cooldown_s" in suppressed["note"]
    assert len(monitor.windows()) == 11  # kept in the registry's store (a directory, or S3)


def test_after_the_cool_down_a_new_streak_raises_again(production, tmp_path):
    monitor = monitor_for(None, tmp_path, production.port, "monitor.cooldown_s=1500", "monitor.consecutive=2")
    states = []
    for i in range(6):
        traffic(tmp_path, T0 + 600 * i, 2.0)
        states.append((monitor.run_window(now=T0 + 600 * (i + 1)).get("alarm") or {}).get("state"))
    assert states == [None, "raised", None, "suppressed", None, "raised"]
    assert len(monitor.alarms()) == 2


def test_an_unavailable_production_is_logged_never_alarmed(tmp_path):
    with serve_in_thread(FastAPI()) as (url, server):
        port = int(url.rsplit(":", 1)[1])
    monitor = monitor_for(None, tmp_path, port, "monitor.consecutive=1")  # nothing listens on the port any more
    traffic(tmp_path, T0 - 600, 1.5)
    window = monitor.run_window(now=T0)
    assert window["verdict"] == "unavailable" and "does not answer /health" in window["reason"]
    assert "alarm" not in window and monitor.alarms() == []
    metrics = monitor_for(None, tmp_path / "metrics", port, "monitor.source=metrics", "production.telemetry.metrics=true")
    window = metrics.run_window(now=T0 + 1)
    assert window["verdict"] == "unavailable" and "does not serve /metrics" in window["reason"]
    gone = Monitor(monitor.monitor, monitor.production, monitor.serving, monitor.registry, log=lambda line: None)
    gone.registry.rollback(["test"], by="test")  # the first promotion rolled back: no production version
    assert gone.run_window(now=T0 + 2)["reason"] == "the registry has no production version"


def test_the_report_plots_windows_per_version_with_the_promotion_marked(production, tmp_path):
    monitor = monitor_for(None, tmp_path, production.port)
    for i, accept in enumerate([3.1, 2.0]):
        traffic(tmp_path, T0 + 600 * i, accept)
        monitor.run_window(now=T0 + 600 * (i + 1))
    windows = monitor.windows()
    history = [{**monitor.registry.history()[0], "time": datetime.fromtimestamp(T0 + 700).astimezone().isoformat()}]
    report = monitor_report(windows, history, {"v1": 2.25}, now=T0 + 1200)
    assert "| code | 2.000 |" in report and report.count("| v1 |") == 2 and "| low |" in report and "| ok |" in report
    svg = base64.b64decode(report.split("data:image/svg+xml;base64,")[1].split(")")[0]).decode()
    assert "accept length on live traffic" in svg and "speedup measured at promotion" in svg
    assert svg.count('stroke-dasharray="3,3"') == 2  # the promotion, marked on both panels


def test_the_command_hands_its_arguments_to_the_flow_process_and_refuses_a_config_without_telemetry(
        monkeypatch, capsys, tmp_path):
    import os
    import sys

    from eagle3.cli import main
    from flows import monitor as flow_monitor

    handed = []
    monkeypatch.setattr(os, "execve", lambda path, argv, env: handed.append((path, argv)))
    main(["monitor", str(TINY), "--set", "monitor.consecutive=2"])
    assert handed == [(sys.executable, [sys.executable, "-m", "flows.monitor", str(TINY), "--set",
                                        "monitor.consecutive=2"])]
    # the tiny config turns no telemetry on: refused in one line, before Prefect starts a run
    assert flow_monitor.main([str(TINY), "--set", f"registry.path={tmp_path}"]) == 1
    assert "production.telemetry.metrics is false" in capsys.readouterr().err
