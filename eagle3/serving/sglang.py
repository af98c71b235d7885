"""SGLang, launched as `python -m sglang.launch_server` in its own environment (data.sglang_python) on the node:
its flags, the ones the launcher refuses to see twice, and its telemetry flags (docs/gpu-node.md)."""

from __future__ import annotations

import httpx

from eagle3.algorithms import DraftAlgorithm, algorithm
from eagle3.config.deployment import TelemetrySection
from eagle3.config.run import TargetSection
from eagle3.config.serving import ServingSection
from eagle3.contract.engines import TWO_BATCH_OVERLAP_LOSES_CAPTURE
from eagle3.contract.releases import parse_release, release_or_newest
from eagle3.procs import LaunchError
from eagle3.records.telemetry import PIPELINE_LABEL
from eagle3.serving.base import LaunchSpec, ServingEngine, flag_of, launcher_flag_for

# Every spelling SGLang's parser accepts for each flag the launcher sets (read from its releases'
# `ServerArgs.add_cli_args`; tests/conformance checks the table against each release's parser).
LAUNCHER_FLAGS = {
    "--model-path": ("--model-path", "--model"),
    "--speculative-algorithm": ("--speculative-algorithm",),
    "--speculative-draft-model-path": ("--speculative-draft-model-path", "--speculative-draft-model"),
    "--speculative-num-steps": ("--speculative-num-steps",),
    "--speculative-eagle-topk": ("--speculative-eagle-topk",),
    "--speculative-num-draft-tokens": ("--speculative-num-draft-tokens",),
    "--tp-size": ("--tp-size", "--tensor-parallel-size"),
    "--host": ("--host",),
    "--port": ("--port",),
    "--context-length": ("--context-length",),
    "--enable-metrics": ("--enable-metrics",),
    "--export-metrics-to-file": ("--export-metrics-to-file",),
    "--export-metrics-to-file-dir": ("--export-metrics-to-file-dir",),
    "--tokenizer-metrics-allowed-custom-labels": ("--tokenizer-metrics-allowed-custom-labels",),
}
TWO_BATCH_OVERLAP_FLAG = "--enable-two-batch-overlap"
SGLANG_NAME = "sglang"  # serving.engine, and the key of a draft algorithm's served_as
# How a release's worker hands the scheduler a verify step, by --speculative-algorithm (a draft algorithm's
# served_as["sglang"]): from the release named here its whole run, counted as EAGLE3's is; before it the run token by
# token, the finish checked after each and only the appended drafts counted, with no histogram (eagle3.bench.counting;
# tests/conformance/test_counting.py). A method not named hands the whole run in every release.
WHOLE_RUN_FROM = {"DFLASH": "0.5.16"}  # the spec-v2 worker; before it the v1 worker's verify appends token by token


def sglang_method(entry: DraftAlgorithm) -> str | None:
    """The --speculative-algorithm SGLang serves `entry`'s drafts with, which the reference server and the simulator
    count them as (None: SGLang serves none)."""
    return entry.served_as.get(SGLANG_NAME)


def appends_token_by_token(method: str | None, release: str | None) -> bool:
    """Whether SGLang `release` (None: the newest rules) appends a verify step's run of `method` token by token."""
    first = WHOLE_RUN_FROM.get(method)
    return first is not None and release_or_newest(release) < parse_release(first)


def telemetry_flags(telemetry: TelemetrySection | None) -> list[str]:
    """SGLang's flags for production.telemetry (the reference server takes the same spellings); [] when off.

    With telemetry on, the custom-label keys the pipeline and its users send are declared: with --enable-metrics
    SGLang's tokenizer manager labels a request's metrics with its custom_labels, and a key its collector was not
    started with raises inside the manager's loop (the server goes down on the benchmark's own re-measure); and
    the OpenAI routes keep only declared keys of an x-custom-labels header, metrics or not."""
    if telemetry is None or not (telemetry.metrics or telemetry.records_dir is not None):
        return []
    flags = ["--enable-metrics"] if telemetry.metrics else []
    if telemetry.records_dir is not None:
        flags += ["--export-metrics-to-file", "--export-metrics-to-file-dir", str(telemetry.records_dir)]
    return flags + ["--tokenizer-metrics-allowed-custom-labels", *custom_label_keys(telemetry)]


def custom_label_keys(telemetry: TelemetrySection) -> list[str]:
    """The custom_labels keys production must declare: the benchmark's own and the operator's slice label."""
    return list(dict.fromkeys([PIPELINE_LABEL[0], telemetry.slice_label]))


def refuse_clashing_flags(serving: ServingSection, target: TargetSection, draft) -> None:
    """serving.extra_args that would contradict the launcher: a speculative algorithm of their own, two-batch overlap
    where it loses the aux capture, or a flag the launcher sets from a field."""
    extra_flags = [a for a in serving.extra_args if a.startswith("--")]
    if any(launcher_flag_for(a, LAUNCHER_FLAGS) == "--speculative-algorithm" for a in extra_flags):
        raise LaunchError(
            f"serving.extra_args {serving.extra_args} sets --speculative-algorithm; the launcher sets it "
            "(EAGLE3 for an EAGLE-3 draft: EAGLE would serve it with the wrong fc input and no aux states); remove it")
    overlap = [a for a in extra_flags
               if TWO_BATCH_OVERLAP_FLAG.startswith(flag_of(a)) and len(flag_of(a)) > len("--enable-t")]
    if draft is not None and overlap and target.family in TWO_BATCH_OVERLAP_LOSES_CAPTURE:
        raise LaunchError(
            f"serving.extra_args sets {overlap[0]}: with two-batch overlap SGLang's {target.family} model file "
            "captures aux hidden states only below first_k_dense_replace (every release read), so the EAGLE3 draft "
            "would get fewer states than it was trained on; remove it for the speculative server")
    set_by_launcher = {a: launcher_flag_for(a, LAUNCHER_FLAGS) for a in extra_flags}
    clash = sorted({f"{flag_of(a)} (= {flag})" for a, flag in set_by_launcher.items() if flag})
    if clash:
        raise LaunchError(f"serving.extra_args repeats {', '.join(clash)}, which the launcher sets from the "
                          "serving section (the telemetry flags from production.telemetry, for the production server "
                          "only: --tokenizer-metrics-allowed-custom-labels declares eagle3 and "
                          "production.telemetry.slice_label); set the field instead")


class SGLang(ServingEngine):
    name = SGLANG_NAME
    title = "SGLang"
    health_path = "/health_generate"  # a generation of one token, not just a live process (/health)

    def reported_release(self, url: str, timeout_s: float) -> str:
        info = httpx.get(f"{url}{self.info_path}", timeout=timeout_s).raise_for_status().json()
        if not isinstance(info, dict) or not info.get("version"):
            raise ValueError(f"{self.info_path} has no version: {info}")
        return str(info["version"])  # its own __version__: it selects the loader rules

    def command(self, spec: LaunchSpec, target, draft, telemetry: TelemetrySection | None = None,
                entry: DraftAlgorithm | None = None) -> list[str]:
        s = spec.serving
        command = [spec.sglang_python, "-m", "sglang.launch_server", "--model-path", str(target)]
        if draft is not None:
            command += (entry or algorithm(spec.draft.algorithm)).server_flags(draft, s)
        command += ["--tp-size", str(s.tp), "--host", s.host, "--port", str(s.port),
                    "--context-length", str(s.context_length)]
        command += ["--trust-remote-code"] if spec.target.trust_remote_code else []
        refuse_clashing_flags(s, spec.target, draft)
        return command + telemetry_flags(telemetry) + list(s.extra_args)

    def served_release(self, reported: str, configured: str | None) -> str | None:
        return reported  # its own __version__: the loader that will read the draft


SGLANG = SGLang()
