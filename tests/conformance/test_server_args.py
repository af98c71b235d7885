"""The launcher's commands through each release's own argument parser."""

from __future__ import annotations

import pytest

from eagle3.resolve import load_config
from eagle3.config.deployment import TelemetrySection
from eagle3.data.regenerate import simulated_shapes
from eagle3.deployment.sweep import with_shape
from eagle3.serving.sglang import LAUNCHER_FLAGS, SGLANG
from eagle3.serving.base import launch_spec
from releases import RELEASES

ROOT = __import__("pathlib").Path(__file__).parents[2]
CONFIGS = {"kimi": ROOT / "configs" / "kimi-k25-8xh200.yaml", "tiny": ROOT / "configs" / "tiny-cpu.yaml"}
RECORDS = "/var/lib/eagle3/request-records"
TELEMETRY = TelemetrySection(metrics=True, records_dir=RECORDS)  # production's: metrics and request records


def launcher_commands() -> dict[str, tuple[list[str], object]]:
    """Each config's plain server, and its speculative server in every drafting shape its sweep serves."""
    commands = {}
    for name, path in CONFIGS.items():
        config = load_config(path, ["serving.engine=sglang"])
        served = [(f"{name}-plain", config, None)] + [
            (f"{name}-s{s.num_steps}k{s.eagle_topk}n{s.num_draft_tokens}-eagle3", with_shape(config, s), "/drafts/candidate")
            for s in simulated_shapes(config.replay_shape, config.sweep)]
        for label, shaped, draft in served:
            command = SGLANG.command(launch_spec(shaped), "/models/target", draft)
            commands[label] = (command[command.index("sglang.launch_server") + 1:], shaped)
        production = SGLANG.command(launch_spec(config), "/models/target", "/drafts/candidate", TELEMETRY)
        commands[f"{name}-production-eagle3"] = (production[production.index("sglang.launch_server") + 1:], config)
    return commands


COMMANDS = launcher_commands()


@pytest.fixture(scope="module", params=RELEASES)
def parser_answer(request, run_sglang):
    job = {"commands": {label: argv for label, (argv, _) in COMMANDS.items()}}
    return request.param, run_sglang(request.param, "server_args", job)


def dest_of(options: dict, spelling: str) -> str:
    (dest,) = [dest for dest, strings in options.items() if spelling in strings]
    return dest


@pytest.mark.parametrize("label", sorted(COMMANDS))
def test_every_launcher_command_parses_to_the_configured_values(parser_answer, label):
    release, answer = parser_answer
    argv, config = COMMANDS[label]
    parsed = answer["parsed"][label]
    assert "error" not in parsed, f"SGLang {release} refuses {argv}: {parsed['error']}"
    s = config.serving
    expected = {"--model-path": "/models/target", "--tp-size": s.tp, "--host": s.host, "--port": s.port,
                "--context-length": s.context_length}
    if label.endswith("eagle3"):
        expected |= {"--speculative-algorithm": "EAGLE3", "--speculative-draft-model-path": "/drafts/candidate",
                     "--speculative-num-steps": s.num_steps, "--speculative-eagle-topk": s.eagle_topk,
                     "--speculative-num-draft-tokens": s.num_draft_tokens}
    else:
        assert parsed[dest_of(answer["options"], "--speculative-algorithm")] is None
    telemetry = {"--enable-metrics": True, "--export-metrics-to-file": True, "--export-metrics-to-file-dir": RECORDS,
                 "--tokenizer-metrics-allowed-custom-labels": ["eagle3", "app"]}  # the benchmark's and the slice key
    if "-production-" not in label:  # candidates and baselines report nothing of their own
        telemetry = {"--enable-metrics": False, "--export-metrics-to-file": False, "--export-metrics-to-file-dir": None,
                     "--tokenizer-metrics-allowed-custom-labels": None}
    expected |= telemetry
    for flag, value in expected.items():
        assert parsed[dest_of(answer["options"], flag)] == value, f"SGLang {release} reads {flag} differently"


def test_launcher_flags_are_declared_spellings_of_every_release(parser_answer):
    """No flag the launcher writes relies on an argparse abbreviation (`--tp` did), and the alias table the
    clash check uses knows every spelling the release accepts for those fields."""
    release, answer = parser_answer
    options = answer["options"]
    for canonical, spellings in LAUNCHER_FLAGS.items():
        matches = [strings for strings in options.values() if canonical in strings]
        assert matches, f"SGLang {release} declares no {canonical}"
        assert set(matches[0]) <= set(spellings), (
            f"SGLang {release} also spells {canonical} as {sorted(set(matches[0]) - set(spellings))}: add it to "
            "LAUNCHER_FLAGS")


def test_no_other_option_is_mistaken_for_an_abbreviation(parser_answer):
    """The clash check treats any prefix of a launcher spelling as that flag; no other option of the
    release may be such a prefix, or a legitimate extra argument would be refused."""
    release, answer = parser_answer
    ours = {spelling for spellings in LAUNCHER_FLAGS.values() for spelling in spellings}
    theirs = {s for strings in answer["options"].values() for s in strings if s.startswith("--")} - ours
    prefixes = sorted(s for s in theirs if any(mine.startswith(s) for mine in ours))
    assert not prefixes, f"SGLang {release} options {prefixes} are prefixes of launcher flags"
