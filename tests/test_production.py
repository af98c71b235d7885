"""The managed production server and its supervisor: where systemd runs, the kept server lives in a transient
systemd scope of its own, so a worker restart (systemd stops the worker's whole cgroup) leaves it running;
without systemd it lives in the worker's process group, and the log says so.

systemd does not run on the test machines: `systemd-run` is replaced by a test double that records its
arguments and execs the command after `--`, as the real one does for a scope. Real processes on 127.0.0.1;
the reference server stands in for SGLang."""

import json
import os
import shlex
import stat
from pathlib import Path

import httpx
import pytest

import eagle3.procs as procs
from drafts import write_draft
from eagle3.deployment.imports import import_draft
from eagle3.deployment.production import Production
from eagle3.deployment.promotion import PROMPTS_FILE, PROMPTS_LAYOUT
from eagle3.errors import Eagle3Error
from eagle3.fsutil import sha256_file
from eagle3.procs import group_alive
from eagle3.procs import LaunchError, in_systemd_scope, systemd_missing
from eagle3.registry.gate import Metrics
from eagle3.registry.registry import decide_against_production, open_registry
from helpers import HELDOUT, MICRO_DRAFT, RELEASE
from ports import free_port


def systemd_here(monkeypatch, tmp_path) -> Path:
    """systemd as the running init, a user manager for a non-root user, and a `systemd-run` that writes its arguments
    to the returned file, one a line, then execs the command after `--` (the real one execs it in the new scope)."""
    running = tmp_path / "run-systemd-system"
    running.mkdir()
    monkeypatch.setattr(procs, "SYSTEMD_RUNNING", running)
    runtime = tmp_path / "xdg-runtime"
    (runtime / "systemd").mkdir(parents=True)
    (runtime / "systemd" / "private").touch()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    argv = tmp_path / "systemd-run.argv"
    script = bin_dir / "systemd-run"
    script.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {shlex.quote(str(argv))}\n'
                      'while [ "$1" != "--" ]; do shift; done\nshift\nexec "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return argv


def no_systemd(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(procs, "SYSTEMD_RUNNING", tmp_path / "no-run-systemd-system")


def test_a_kept_production_server_runs_in_a_systemd_scope_until_released(production_config, monkeypatch, tmp_path):
    argv = systemd_here(monkeypatch, tmp_path)
    config = production_config("production.supervisor=systemd")
    unit = f"eagle3-production-{config.production.port}.scope"
    lines = []
    production = Production(config, open_registry(config.registry, log=lambda line: None), lines.append)
    measured = production.serve("v1", "test")
    recorded = production.recorded()
    try:
        assert measured["accept_length"] is not None and recorded["unit"] == unit and group_alive(recorded["pgid"])
        seen = argv.read_text().splitlines()
        user = ["--user"] if os.geteuid() != 0 else []  # not root: the user's own systemd manager
        assert seen[:seen.index("--")] == [*user, "--scope", f"--unit={unit}", "--quiet", "--collect"]
        assert seen[seen.index("--") + 1:][1:4] == ["-m", "eagle3.cli", "serve"]
        # the recorded process group is led by the server itself: systemd-run execs it, no wrapper in between
        assert "eagle3.cli" in Path(f"/proc/{recorded['pgid']}/cmdline").read_bytes().decode().split("\0")
        assert httpx.get(f"{production.url}/health", timeout=10).status_code == 200
        assert f"[production managed {production.url}] production runs in systemd unit {unit}: a worker restart " \
               "leaves it running" in lines
        assert any(f"launcher local, systemd unit {unit}] healthy" in line for line in lines)
    finally:
        production.release_node()
    assert not group_alive(recorded["pgid"]) and production.recorded() is None
    assert any(f"process group {recorded['pgid']}, systemd unit {unit})" in line for line in lines)


def test_a_required_systemd_that_is_missing_fails_before_production_stops(production_config, monkeypatch, tmp_path):
    systemd_here(monkeypatch, tmp_path)
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))  # systemd runs, but systemd-run is not on PATH
    config = production_config("production.supervisor=systemd")
    production = Production(config, open_registry(config.registry, log=lambda line: None), lambda line: None)
    with pytest.raises(LaunchError, match=r"production.supervisor is systemd, but systemd-run is not on PATH; .*"
                                          r"set production.supervisor to auto or none"):
        production.serve("v1", "test")
    assert not config.production.state_dir.exists()  # nothing fetched, nothing stopped, nothing started


@pytest.mark.parametrize(("supervisor", "systemd", "unit", "said"), [
    ("auto", False, None, "no systemd here (systemd is not running on this machine (no "),
    ("auto", True, "eagle3-production-{port}.scope", "production runs in systemd unit eagle3-production-{port}.scope"),
    ("none", True, None, "production.supervisor is none: production lives in the worker's process group"),
])
def test_the_supervisor_follows_the_config_and_the_machine(production_config, monkeypatch, tmp_path, supervisor,
                                                           systemd, unit, said):
    systemd_here(monkeypatch, tmp_path) if systemd else no_systemd(monkeypatch, tmp_path)
    config = production_config(f"production.supervisor={supervisor}")
    port = config.production.port
    lines = []
    production = Production(config, None, lines.append)
    assert production.supervisor_unit() == (unit.format(port=port) if unit else None)
    assert len(lines) == 1 and said.format(port=port) in lines[0]
    assert lines[0].endswith("a worker restart leaves it running" if unit else "a worker restart stops it")


def test_a_user_without_root_gets_the_user_manager(monkeypatch, tmp_path):
    monkeypatch.setattr(procs, "SYSTEMD_RUNNING", tmp_path)
    monkeypatch.setattr(procs.os, "geteuid", lambda: 1000)
    tool = tmp_path / "systemd-run"
    tool.touch(mode=0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)  # as in a system service's environment
    scope = ["systemd-run", "--user", "--scope", "--unit=u.scope", "--quiet", "--collect", "--", "serve", "--port", "1"]
    assert in_systemd_scope(["serve", "--port", "1"], "u.scope") == ["env", "XDG_RUNTIME_DIR=/run/user/1000", *scope]
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert in_systemd_scope(["serve", "--port", "1"], "u.scope") == scope
    assert systemd_missing().startswith(f"no systemd user manager for uid 1000 (no {tmp_path}/systemd/private); "
                                        "`loginctl enable-linger USER`")
    (tmp_path / "systemd").mkdir()
    (tmp_path / "systemd" / "private").touch()
    assert systemd_missing() is None


def test_production_is_remeasured_on_the_prompt_set_its_version_recorded(production_config, tmp_path):
    """A retrain measures on its own held-out prompts; production's re-measure uses the set it was promoted on."""
    config = production_config("production.keep_serving=false", "production.supervisor=none")
    registry = open_registry(config.registry, log=lambda line: None)
    own = tmp_path / "v2-benchmark"
    own.mkdir()
    (own / PROMPTS_FILE).write_text(json.dumps({"messages": [{"role": "user", "content": "What is a tuple?"}]}) + "\n")
    recorded = {"file": f"{PROMPTS_LAYOUT}/{PROMPTS_FILE}", "sha256": sha256_file(own / PROMPTS_FILE), "prompts": 1,
                "max_new_tokens": 5}
    registry.publish("v2", {"sglang": tmp_path / "export" / "sglang", PROMPTS_LAYOUT: own}, {"benchmark": recorded})
    lines = []
    production = Production(config, registry, lines.append)
    measured = production.remeasure("v2")
    assert [row["completion_tokens"] for row in measured["prompts"]] == [5]  # its one prompt, its max_new_tokens
    assert any(f"own prompt set: 1 of its 1 prompts (sha256 {recorded['sha256'][:12]}), max_new_tokens 5" in line
               for line in lines)
    older = production.remeasure("v1")  # published without a prompt set: this run's two held-out prompts
    assert [row["completion_tokens"] for row in older["prompts"]] == [8, 8]
    assert any("v1 records no prompt set" in line for line in lines)


def imported_as_production(production_config, tmp_path, *overrides):
    """Production v1, and a draft written elsewhere (another seed) imported with --as-production: (config, registry,
    the source, the log lines, the import's result or the error it raised)."""
    config = production_config(f"serving.port={free_port()}", *overrides)
    registry = open_registry(config.registry, log=lambda line: None)
    registry.promote("v1", None, ["production before the import"], by="test")
    source = write_draft(tmp_path / "elsewhere", layout="sglang", release=RELEASE, seed=1, **MICRO_DRAFT)
    lines = []
    try:
        outcome = import_draft(config, str(source), as_production=True, log=lines.append)
    except Eagle3Error as err:
        outcome = err
    return config, registry, lines, outcome


def test_a_draft_imported_as_production_is_the_baseline_the_next_run_is_gated_against(production_config, tmp_path):
    config, registry, lines, result = imported_as_production(production_config, tmp_path,
                                                             "production.keep_serving=false",
                                                             "production.supervisor=none")
    version = result["version"]
    manifest = registry.manifest(version)
    recorded = manifest["metrics"]["served"]["accept_length"]
    assert registry.production_version() == version and result["production"]["previous"] == "v1"
    # measured on the run's benchmark prompts before it was published, then served as production and re-measured
    assert manifest["layouts"] == [PROMPTS_LAYOUT, "sglang"] and manifest["benchmark"]["prompts"] == len(HELDOUT)
    assert result["production"]["measured"]["accept_length"] == recorded >= 1.0
    assert any(f"version {version} measures accept length {recorded:.3f}, recorded {recorded:.3f}: as promoted" in line
               for line in lines)
    promoted = registry.history()[-1]
    assert (promoted["event"], promoted["version"], promoted["previous"]) == ("promoted", version, "v1")
    assert promoted["reasons"][0] == "imported as production"
    # the next run's gate judges a candidate against the imported draft's figures
    floor = recorded * (1 - config.gate.production_tolerance)
    worse = decide_against_production(registry, Metrics(accept_length=floor - 0.01, accept_rate=0.9), version,
                                      config.gate)
    assert [r.rule for r in worse.reasons] == ["regression"]
    assert f"below production's {recorded:.3f}" in worse.reasons[0].message
    level = decide_against_production(registry, Metrics(accept_length=recorded, accept_rate=0.9), version, config.gate)
    assert "regression" not in [r.rule for r in level.reasons]


def test_an_import_that_production_cannot_serve_is_rolled_back(production_config, monkeypatch, tmp_path):
    no_systemd(monkeypatch, tmp_path)  # production.supervisor systemd is then refused when production starts
    _, registry, lines, error = imported_as_production(production_config, tmp_path, "production.supervisor=systemd")
    assert isinstance(error, LaunchError) and "production.supervisor is systemd" in str(error)
    (version,) = set(registry.versions()) - {"v1"}  # measured and published: a version, not production
    assert registry.production_version() == "v1"
    events = [(entry["event"], entry["version"]) for entry in registry.history()]
    assert events[-2:] == [("promoted", version), ("rolled-back", "v1")]
    assert any(line.startswith("import: restoring production v1 failed: LaunchError") for line in lines)


def test_an_external_production_is_reported_not_restarted(production_config, tmp_path):
    config = production_config("production.mode=external", f"production.state_dir={tmp_path / 'external'}")
    lines = []
    production = Production(config, open_registry(config.registry), lines.append)
    production.release_node()
    assert production.serve("v1", "promoted") is None and not (tmp_path / "external").exists()
    assert "external" in lines[0] and "v1" in lines[1] and "does not restart it" in lines[1]
