"""A target of Kimi's tokenizer kind (tests/kimi_target.py: tiktoken.model + its own tokenization_kimi.py through
auto_map): trusted, it loads everywhere; untrusted, config load refuses it in one line, and no command waits on
stdin. Its identity follows every file its tokenizer reads; its template's thinking switch is read from the
template; one precision per target; the config checks on K2.5's text_config layout."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from eagle3.config import check_local_inputs
from eagle3.resolve import load_config
from eagle3.config.run import TargetSection
from eagle3.data.conversation import prompt_ids, render
from eagle3.data.importer import Where, conversation_row
from eagle3.runtime.generators import LocalGenerator
from eagle3.runtime.targets import load_target_model, load_tokenizer, resolve_dtype, target_identity
from eagle3.errors import ConfigError, UnreadableInput
from eagle3.target.files import thinking_switches
from eagle3.serving.reference import REFERENCE
from eagle3.serving.sglang import SGLANG
from eagle3.serve.reference import load as load_served
from eagle3.shape import DraftShape
from eagle3.stages.keys import stage_key
from eagle3.serving.base import launch_spec
from helpers import ROOT, TINY
from kimi_target import BPE_SIZE, END_OF_TURN_ID, VOCAB_SIZE, write_k25_config
KIMI_SIZES = ["target.hidden_size=64", f"target.vocab_size={VOCAB_SIZE}", "vocab.draft_vocab_size=128",
              "data.aux_layers=[1, 2]"]


def kimi_config(target, tmp_path, *extra):
    return load_config(TINY, [f"run.dir={tmp_path / 'run'}", f"target.path={target}", *KIMI_SIZES, *extra])


def test_trusted_the_kimi_tokenizer_tokenizes_and_templates_like_kimi(kimi_target):
    tokenizer = load_tokenizer(TargetSection(path=str(kimi_target), family="llama", num_hidden_layers=4,
                                             hidden_size=64, vocab_size=VOCAB_SIZE, trust_remote_code=True))
    assert type(tokenizer).__name__ == "TikTokenTokenizer" and len(tokenizer) == VOCAB_SIZE
    text = "The with statement, ünïcode ✓"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text and max(ids) < BPE_SIZE
    marked = tokenizer("a<|im_end|>b", add_special_tokens=False)["input_ids"]
    assert END_OF_TURN_ID in marked and tokenizer.eos_token_id == END_OF_TURN_ID
    messages = [{"role": "user", "content": "hi"}]
    assert render(tokenizer, messages, True, True).endswith("<|im_middle|><think>")
    assert render(tokenizer, messages, False, True).endswith("<|im_middle|><think></think>")
    assert prompt_ids(tokenizer, messages, True)[-1] == BPE_SIZE + 256  # <think>: the first of the two extra ids


def test_untrusted_it_fails_at_config_load_in_one_line_and_never_reads_stdin(kimi_target, tmp_path):
    with pytest.raises(ConfigError, match=r"target\.trust_remote_code is false but .*tokenizer_config\.json names "
                       r"Python code in auto_map \(tokenization_kimi\.py\)"):
        check_local_inputs(kimi_config(kimi_target, tmp_path))
    check_local_inputs(kimi_config(kimi_target, tmp_path, "target.trust_remote_code=true"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    sets = [arg for value in [f"target.path={kimi_target}", f"run.dir={tmp_path / 'run'}", *KIMI_SIZES]
            for arg in ("--set", value)]
    # `eagle3 config`, `eagle3 run` and the step commands that load the target's tokenizer
    for command in (["eagle3.cli", "config", str(TINY)], ["flows.run", str(TINY)],
                    *[["eagle3.cli", *step, "--config", str(TINY)] for step in
                      (["data", "regenerate"], ["data", "import"], ["data", "quality"], ["vocab", "build"])]):
        result = subprocess.run([sys.executable, "-m", *command, *sets],
                                stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env, timeout=120)
        assert result.returncode != 0 and len(result.stderr.strip().splitlines()) == 1, (command, result.stderr)
        assert "target.trust_remote_code" in result.stderr and "tokenization_kimi.py" in result.stderr
    # a loader handed the path alone refuses too (never a prompt): the flag is always passed
    with pytest.raises(UnreadableInput, match="set target.trust_remote_code"):
        load_tokenizer(kimi_target)


def test_one_changed_rank_in_tiktoken_model_changes_the_identity_and_the_data_stage_key(kimi_target, tmp_path):
    target = shutil.copytree(kimi_target, tmp_path / "target")
    config = kimi_config(target, tmp_path, "target.trust_remote_code=true")
    before, key = target_identity(config.target), stage_key("regenerate", config, [])
    ranks = (target / "tiktoken.model").read_text().splitlines()
    (first, rank_a), (second, rank_b) = ranks[300].split(), ranks[301].split()
    ranks[300], ranks[301] = f"{first} {rank_b}", f"{second} {rank_a}"  # two merges swap ranks
    (target / "tiktoken.model").write_text("\n".join(ranks) + "\n")
    assert target_identity(config.target)["tokenizer_sha256"] != before["tokenizer_sha256"]
    assert stage_key("regenerate", config, []) != key  # the data stage runs again
    code = target / "tokenization_kimi.py"  # the tokenizer's own code is part of it too
    hashed = target_identity(config.target)["tokenizer_sha256"]
    code.write_text(code.read_text() + "\n# changed\n")
    assert target_identity(config.target)["tokenizer_sha256"] != hashed


def test_data_thinking_needs_a_template_switch_and_renders_with_the_templates_own_name(kimi_target, micro_target,
                                                                                         tmp_path):
    with pytest.raises(ConfigError, match=r"data\.thinking is true but the target .* reads no thinking switch"):
        check_local_inputs(load_config(TINY, [f"target.path={micro_target}", "target.hidden_size=64",
                                              "target.vocab_size=512", "vocab.draft_vocab_size=128",
                                              "data.thinking=true"]))
    check_local_inputs(kimi_config(kimi_target, tmp_path, "target.trust_remote_code=true", "data.thinking=true"))


def test_the_importer_moves_inline_reasoning_where_the_template_renders_it(kimi_target, tmp_path):
    tokenizer = load_tokenizer(kimi_target, trust_remote_code=True)
    row = {"messages": [{"role": "user", "content": "why?"},
                        {"role": "assistant", "content": "<think>because of x</think>the answer"}]}
    record = conversation_row(row, json.dumps(row).encode(), Where(tmp_path / "rows.jsonl", 1), tokenizer, True)
    text = tokenizer.decode(record["input_ids"])
    assert text.count("because of x") == 1 and "<think>because of x</think>the answer<|im_end|>" in text
    assert record["conversation"][-1]["reasoning_content"] == "because of x"


def test_the_k25_text_config_layout_is_checked_for_sizes_family_and_code(kimi_target, tmp_path):
    target = write_k25_config(tmp_path / "k25", layers=4, hidden=64, vocab=VOCAB_SIZE)
    for name in ("tiktoken.model", "tokenization_kimi.py", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(kimi_target / name, target / name)
    with pytest.raises(ConfigError, match=r"target\.family is llama but .* names architecture "
                       "KimiK25ForConditionalGeneration, which SGLang serves with its kimi_k25 model file"):
        check_local_inputs(kimi_config(target, tmp_path, "target.trust_remote_code=true"))
    with pytest.raises(ConfigError, match=r"target\.hidden_size is 32 but .* says 64"):
        check_local_inputs(kimi_config(target, tmp_path, "target.trust_remote_code=true", "target.family=kimi_k25",
                                       "target.hidden_size=32"))
    # the shipped K2.5 config names the model file kimi_k25.py delegates to: the same served model
    check_local_inputs(kimi_config(target, tmp_path, "target.trust_remote_code=true", "target.family=deepseek_v2"))
    (target / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    with pytest.raises(ConfigError, match=r"config\.json names Python code in auto_map \(configuration_kimi_k25\.py\)"):
        check_local_inputs(kimi_config(target, tmp_path, "target.family=kimi_k25"))
    assert resolve_dtype(target) == "bfloat16"  # text_config's torch_dtype


def test_sglang_and_the_reference_server_get_the_setting(kimi_target, tmp_path):
    config = kimi_config(kimi_target, tmp_path, "target.trust_remote_code=true", "target.dtype=bfloat16")
    assert "--trust-remote-code" in SGLANG.command(launch_spec(config), kimi_target, None)
    command = REFERENCE.command(launch_spec(config), kimi_target, None)
    assert "--trust-remote-code" in command and command[command.index("--dtype") + 1] == "bfloat16"
    assert "--trust-remote-code" not in REFERENCE.command(launch_spec(kimi_config(kimi_target, tmp_path)), kimi_target, None)


def test_the_generator_and_the_reference_server_run_the_target_in_its_own_precision(micro_target, tmp_path):
    target = shutil.copytree(micro_target, tmp_path / "target")
    config = json.loads((target / "config.json").read_text())
    config.pop("dtype", None)
    (target / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    section = TargetSection(path=str(target), family="llama", num_hidden_layers=4, hidden_size=64, vocab_size=512)
    assert resolve_dtype(target) == "bfloat16" and resolve_dtype(micro_target) == "float32"
    generator = LocalGenerator(section, max_new_tokens=8, temperature=0.0)
    served = load_served(target, None, DraftShape(3), None)
    assert generator.model.dtype == served.target.dtype == torch.bfloat16
    assert load_target_model(section, dtype="float32").dtype == torch.float32  # the config can say otherwise
    assert target_identity(section)["dtype"] == "bfloat16"


def test_the_thinking_switch_is_the_variable_the_template_reads():
    assert thinking_switches("{% if enable_thinking %}<think>{% endif %}") == ("enable_thinking",)
    assert thinking_switches("{%- generation -%}{{ thinking }}{%- endgeneration -%}") == ("thinking",)
    assert thinking_switches("{% set thinking = true %}{{ thinking }}{{ messages }}") == ()  # set, not read
    assert thinking_switches(None) == ()
