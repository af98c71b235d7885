"""The vLLM serving engine's entry (eagle3/serving/vllm.py): its command line for each draft algorithm, what it refuses
before anything starts, where it finds vLLM's environment, and how it reads a completion's speculative counts. vLLM
itself serving our drafts, measured by this client: tests/conformance/test_vllm_server.py."""

from __future__ import annotations

import json
import re

import pytest
import torch

from eagle3.algorithms import algorithm
from eagle3.algorithms.dflash import DFLASH
from eagle3.algorithms.eagle3 import EAGLE3
from eagle3.bench.client import summarize
from eagle3.bench.simulate import counting_release
from drafts import MLA, tiny_draft
from family_targets import MLA_DRAFT_CONFIG
from eagle3.resolve import load_config
from eagle3.draft.files import Verifier
from eagle3.algorithms.eagle3.checkpoint import save_native_draft
from eagle3.errors import ConversionError
from eagle3.plan import serving_stage
from eagle3.procs import LaunchError
from eagle3.target.info import read_target_size
from eagle3.serving.vllm import NEUTRAL_SAMPLING, VLLM_ENGINE
from eagle3.serving.vllm_env import COMPLETE, vllm_env_dir, vllm_python
from eagle3.serving.base import launch_spec
from helpers import TINY
from ports import free_port

PYTHON = "/envs/vllm/bin/python"


def config_for(tmp_path, *overrides):
    return load_config(TINY, [f"run.dir={tmp_path}", f"serving.port={free_port()}", "serving.context_length=512",
                              "serving.engine=vllm", f"serving.python={PYTHON}", "sweep.points=[[1, 1, 2]]", *overrides])


def speculative_config_of(command: list[str]) -> dict:
    return json.loads(command[command.index("--speculative-config") + 1])


def test_vllm_command_with_and_without_a_draft(tmp_path):
    config = config_for(tmp_path, "serving.num_steps=5", "serving.extra_args=[--dtype, float32]")
    command = VLLM_ENGINE.command(launch_spec(config), "/t", "/d", entry=EAGLE3)
    assert command[:4] == [PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model"]
    assert speculative_config_of(command) == {"method": "eagle3", "model": "/d", "num_speculative_tokens": 5}
    assert command[command.index("--per-request-spec-decode-metrics") + 1] == "summary"  # the client's counts
    assert command[-2:] == ["--dtype", "float32"]
    assert command[command.index("--max-model-len") + 1] == "512"
    plain = VLLM_ENGINE.command(launch_spec(config), "/t", None)
    assert "--speculative-config" not in plain and "--per-request-spec-decode-metrics" not in plain


def test_a_dflash_draft_drafts_its_block_less_the_verified_token(tmp_path):
    config = config_for(tmp_path, "serving.num_steps=2")  # blocks of 3: the verified token and 2 drafts
    command = VLLM_ENGINE.command(launch_spec(config), "/t", "/d", entry=DFLASH)
    assert speculative_config_of(command) == {"method": "dflash", "model": "/d", "num_speculative_tokens": 2}


def test_a_tree_is_refused_naming_the_field(tmp_path):
    config = config_for(tmp_path, "serving.num_steps=3", "serving.eagle_topk=4", "serving.num_draft_tokens=8")
    with pytest.raises(LaunchError, match="serving.eagle_topk 4: vLLM drafts a chain here"):
        VLLM_ENGINE.command(launch_spec(config), "/t", "/d", entry=EAGLE3)


@pytest.mark.parametrize("extra, named", [
    ("--speculative-config=x", "--speculative-config (= --speculative-config)"),
    ("--speculative-config.num_speculative_tokens=2", "--speculative-config.num-speculative-tokens (= --speculative-config)"),
    ("-sc", "-sc (= --speculative-config)"),
    ("--spec-tokens", "--spec-tokens (= --speculative-config)"),
    ("-tp", "-tp (= --tensor-parallel-size)"),
    ("--max-model", "--max-model (= --max-model-len)"),
])
def test_extra_args_may_not_repeat_a_flag_the_launcher_sets(tmp_path, extra, named):
    config = config_for(tmp_path, f"serving.extra_args=[{extra}]")
    with pytest.raises(LaunchError, match=re.escape(named)):
        VLLM_ENGINE.command(launch_spec(config), "/t", "/d", entry=EAGLE3)


def check(config):
    """vLLM's refusals of `config` before any stage, as `eagle3 config` asks them."""
    return VLLM_ENGINE.check(launch_spec(config), config.production.telemetry, config.sweep)


def test_request_records_are_refused_for_vllm(tmp_path):
    config = config_for(tmp_path, f"production.telemetry.records_dir={tmp_path / 'records'}")
    with pytest.raises(LaunchError, match="production.telemetry.records_dir: vLLM writes no request records"):
        check(config)


def test_the_environment_install_vllm_made_is_found_and_a_missing_one_named(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE3_VLLM_CACHE", str(tmp_path))
    with pytest.raises(LaunchError, match=r"no vLLM environment at .*; run `eagle3 install-vllm`"):
        vllm_python(None)
    vllm_env_dir().mkdir(parents=True)
    with pytest.raises(LaunchError, match="no vLLM environment"):  # an interrupted install is no environment
        vllm_python(None)
    (vllm_env_dir() / COMPLETE).touch()
    assert vllm_python(None) == str(vllm_env_dir() / "bin" / "python")
    assert vllm_python("/my/python") == "/my/python"


def completion(tokens: list[int], histogram: list[int] | None) -> dict:
    """A completion as vLLM 0.32 answers one with --per-request-spec-decode-metrics summary (a drafted request) or
    without a draft (histogram None)."""
    answer = {"choices": [{"index": 0, "text": "x", "token_ids": tokens, "finish_reason": "length"}],
              "usage": {"prompt_tokens": 7, "completion_tokens": len(tokens), "total_tokens": 7 + len(tokens)}}
    if histogram is not None:
        steps, accepted = sum(histogram), sum(j * n for j, n in enumerate(histogram))
        answer["metrics"] = {"speculative_decoding": {
            "mean_acceptance_length": 1 + accepted / steps, "draft_acceptance_rate": accepted / (3 * steps),
            "acceptance_histogram": histogram, "num_spec_steps": steps, "num_accepted_draft_tokens": accepted,
            "num_draft_tokens": 3 * steps, "num_spec_tokens": 3}}
    return answer


def test_a_completion_is_read_as_sglangs_generate_answer():
    answer = VLLM_ENGINE.read_answer(completion([5, 6, 7, 8, 9, 10], [1, 2, 0, 0]))
    assert answer["output_ids"] == [5, 6, 7, 8, 9, 10]
    assert answer["meta_info"] == {
        "prompt_tokens": 7, "completion_tokens": 6, "finish_reason": {"type": "length"}, "spec_verify_ct": 3,
        "spec_num_correct_drafts": 2, "spec_num_proposed_drafts": 9, "spec_correct_drafts_histogram": [1, 2],
        "spec_accept_rate": 2 / 9, "spec_drafts_per_step": 3}
    plain = VLLM_ENGINE.read_answer(completion([5, 6], None))["meta_info"]
    assert not any(key.startswith("spec_") for key in plain)


def test_the_client_counts_vllm_answers_as_sglangs():
    """Accept length is completion tokens per verify step for every engine (docs/contracts.md), so a vLLM figure
    compares with the simulator's and SGLang's; the accept rate's drafts per step come with vLLM's answers."""
    answers = [VLLM_ENGINE.read_answer(completion(list(range(6)), [1, 2, 0, 0])),
               VLLM_ENGINE.read_answer(completion(list(range(9)), [0, 1, 1, 1]))]
    result = summarize("http://vllm", VLLM_ENGINE.read_info({"version": "0.32.0"}), [(a, 0.1, 1) for a in answers], 1.0)
    assert (result["server_version"], result["draft_tokens_per_step"]) == ("0.32.0", 3)
    assert (result["verify_ct"], result["correct_drafts"]) == (6, 2 + 6)
    assert result["accept_length"] == 15 / 6 and result["accept_rate"] == 8 / 18
    assert result["histogram"] == [1, 3, 1, 1]


@pytest.mark.parametrize("extra, share", [([], 0.92), (["--gpu-memory-utilization", "0.5"], 0.5),
                                          (["--gpu_memory_utilization=0.8"], 0.8)])
def test_the_plan_leaves_what_vllm_does_not_take_of_each_gpu(tmp_path, micro_target, extra, share):
    config = config_for(tmp_path, f"serving.extra_args={json.dumps(extra)}", f"target.path={micro_target}",
                        "target.hidden_size=64", "target.vocab_size=512", "vocab.draft_vocab_size=128")
    (name, gib), = VLLM_ENGINE.memory_left_unused(config.serving, 80.0).items()
    assert name == f"left unused by vLLM (--gpu-memory-utilization {share})" and gib == round((1 - share) * 80, 2)
    entry = algorithm(config.draft.algorithm)
    cfg = entry.draft_config(config.draft, config.target, config.vocab.draft_vocab_size, config.data.aux_layers)
    stage = serving_stage(entry, cfg, config.draft, config.serving, config.node, read_target_size(micro_target))
    assert name in stage.parts


def test_the_simulator_counts_a_vllm_run_as_vllm_finishes_it(tmp_path):
    """vLLM stops at the first stop token inside a step's run (SGLang's rule from 0.5.18), whatever SGLang release the
    stored layout is validated for; the reference server counts as the release it stands for."""
    assert config_for(tmp_path, "serving.release=0.5.13").serving.release == "0.5.13"
    assert counting_release(config_for(tmp_path, "serving.release=0.5.13").serving) is None
    reference = config_for(tmp_path, "serving.release=0.5.13", "serving.engine=reference")
    assert counting_release(reference.serving) == "0.5.13"


def test_an_mla_draft_has_no_speculators_form_and_says_so(tmp_path):
    """vLLM loads the speculators layout, whose decoder layer is Llama's: an MLA draft is refused at conversion, by
    name, before any server starts."""
    draft = tiny_draft(**MLA)
    verifier = Verifier("target", ["LlamaForCausalLM"], torch.zeros(draft.config.vocab_size, draft.config.hidden_size))
    with pytest.raises(ConversionError, match="the draft's attention is mla: speculators' layout holds a Llama decoder"):
        save_native_draft(draft, tmp_path / "out", to="speculators", verifier=verifier)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("override, refusal", [
    ("sweep.points=[[1, 1, 2], [3, 4, 8]]", r"sweep.points \[\(3, 4, 8\)\]: vLLM drafts chains here"),
    ("serving.extra_args=[--disable-log-st]", "sets --disable-log-st: vLLM would stop counting"),
    ("serving.extra_args=[--gpu-memory-util, '1.5']", r"--gpu-memory-utilization '1.5' is no share of memory"),
])
def test_what_a_later_launch_would_refuse_is_refused_before_any_stage(tmp_path, override, refusal):
    """The flow's load-config asks the engine's check: a sweep point, a draft or a flag vLLM cannot serve is refused
    before the data and training stages, not at the first launch after them."""
    config = config_for(tmp_path, override)
    with pytest.raises(LaunchError, match=refusal):
        check(config)
        VLLM_ENGINE.memory_left_unused(config.serving, 80.0)
    assert check(config_for(tmp_path, "sweep.enabled=false", "sweep.points=[[3, 4, 8]]")) is None


def test_an_mla_draft_config_is_refused_for_vllm_before_any_stage(tmp_path):
    config = load_config(MLA_DRAFT_CONFIG, [f"run.dir={tmp_path}", "serving.engine=vllm", f"serving.python={PYTHON}",
                                            "sweep.points=[[1, 1, 2]]"])
    with pytest.raises(LaunchError, match="draft.attention mla: vLLM loads the speculators layout"):
        check(config)


def test_every_vllm_request_asks_for_plain_greedy_sampling():
    """vLLM would otherwise take sampling defaults (a repetition penalty, say) from the target's
    generation_config.json, and its greedy output would part from the sequence the simulator replays."""
    body = VLLM_ENGINE.request_body([1, 2, 3], 8, 0.0, {})
    assert body | NEUTRAL_SAMPLING == body and body["repetition_penalty"] == 1.0 and body["top_k"] == 0
    assert VLLM_ENGINE.request_body([1], 8, 0.0, {}, ignore_eos=True)["ignore_eos"] is True


def test_an_answer_that_is_not_the_engines_is_refused_naming_the_engine():
    """The benchmark client, the data stage's client and the diagnosis read answers through ServingEngine.answer: an
    answer without the output ids or the completion tokens names the engine and shows what came back."""
    assert VLLM_ENGINE.answer(completion([5, 6], None))["output_ids"] == [5, 6]
    with pytest.raises(ValueError, match=r"not a vLLM answer \(ValueError: not enough values to unpack"):
        VLLM_ENGINE.answer({"choices": [], "usage": {}})
    with pytest.raises(ValueError, match=r"not a vLLM answer \(KeyError: 'usage'\): \{'choices'"):
        VLLM_ENGINE.answer({"choices": [{"token_ids": [1], "text": "", "finish_reason": "stop"}]})
