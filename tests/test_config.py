import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3.cli import main
from eagle3.config import check_local_inputs, resolved_config_file, sglang_default_aux_layers
from eagle3.resolve import derived, load_config
from eagle3.errors import ConfigError
from helpers import KIMI, ROOT, TINY


def test_shipped_configs_validate():
    tiny = load_config(TINY)
    assert tiny.target.family == "llama" and tiny.data.aux_layers == [0, 1, 2]
    kimi = load_config(KIMI)
    assert (kimi.target.num_hidden_layers, kimi.target.hidden_size, kimi.target.vocab_size) == (61, 7168, 163840)
    assert kimi.vocab.draft_vocab_size == 32000 and kimi.target.family == "deepseek_v2" and kimi.serving.tp == 8
    assert kimi.data.aux_layers == [1, 29, 57]  # SGLang's default inputs [2, 30, 58], in our convention
    assert kimi.serving.num_draft_tokens == kimi.serving.num_steps + 1


def test_every_stage_lives_under_the_run_directory():
    from eagle3.stages.table import RECORDS, STAGES, output_of, record_path

    config = load_config(TINY, ["run.dir=/tmp/somewhere"])
    outputs = [output_of(config, stage) for stage in STAGES] + [record_path(config, record) for record in RECORDS]
    assert all(path.is_relative_to("/tmp/somewhere") for path in outputs), outputs
    assert config.stage_dir("vocab") == Path("/tmp/somewhere/vocab")
    with pytest.raises(ValueError, match="unknown run directory 'nope'; they are data, vocab"):
        config.stage_dir("nope")


def test_retrain_runs_kept_defaults_to_three_and_is_at_least_one():
    assert load_config(TINY).run.keep_runs == 3
    with pytest.raises(ConfigError, match=r"run.keep_runs \(from --set\): Input should be greater than or equal to 1"):
        load_config(TINY, ["run.keep_runs=0"])


def test_override_is_applied_and_parsed_as_yaml():
    config = load_config(TINY, ["training.learning_rate=0.01", "data.aux_layers=[0, 2]", "data.thinking=true"])
    assert config.training.learning_rate == 0.01
    assert config.data.aux_layers == [0, 2]
    assert config.data.thinking is True


def test_unknown_field_names_file_dotted_field_and_allowed_fields():
    with pytest.raises(ConfigError) as err:
        load_config(TINY, ["data.temprature=0.5"])
    message = str(err.value)
    assert str(TINY) in message and "data.temprature (from --set): unknown field" in message
    assert "temperature" in message and "aux_layers" in message


def test_override_is_revalidated():
    with pytest.raises(ConfigError, match=r"training.learning_rate \(from --set\): Input should be greater than 0 \(got -1\)"):
        load_config(TINY, ["training.learning_rate=-1"])


def test_literal_error_lists_allowed_values():
    with pytest.raises(ConfigError, match=r"serving.engine.*'reference', 'sglang' or 'vllm'"):
        load_config(TINY, ["serving.engine=tgi"])


def test_missing_section_is_named(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(TINY.read_text().replace("vocab:\n  draft_vocab_size: 1024\n", ""))
    with pytest.raises(ConfigError, match=r"c.yaml: vocab: required field is missing"):
        load_config(path)


def test_default_aux_layers_collapse_on_a_small_target():
    assert sglang_default_aux_layers(4) == [1, 1, 0]
    with pytest.raises(ConfigError, match=r"aux_layers \(SGLang's default for a 4-layer target\) \[1, 1, 0\] repeats a layer.*\[0, 1, 2\]"):
        load_config(TINY, ["data.aux_layers=null"])


@pytest.mark.parametrize(
    ("layers", "pattern"),
    [("[2, 0, 1]", "must be ascending"), ("[0, 3]", r"in \[0, 2\]"), ("[1, 1]", "repeats a layer")],
)
def test_bad_aux_layers(layers, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(TINY, [f"data.aux_layers={layers}"])


def test_cross_section_checks():
    with pytest.raises(ConfigError, match=r"serving.context_length \(4096\) exceeds draft.max_position_embeddings"):
        load_config(TINY, ["serving.context_length=4096"])
    with pytest.raises(ConfigError, match="draft_vocab_size"):
        load_config(TINY, ["vocab.draft_vocab_size=5000"])
    with pytest.raises(ConfigError, match="num_draft_tokens must be num_steps"):
        load_config(TINY, ["serving.num_draft_tokens=9"])
    with pytest.raises(ConfigError, match="not a release number"):
        load_config(TINY, ["serving.release=latest"])
    with pytest.raises(ConfigError, match="needs registry.bucket"):
        load_config(TINY, ["registry.backend=s3"])


def test_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_cli_prints_resolved_config_and_one_line_errors(micro_target, capsys):
    target = [f"target.path={micro_target}", "target.hidden_size=64", "target.vocab_size=512", "vocab.draft_vocab_size=128"]
    assert main(["config", str(TINY), "--set", "run.name=x", *[arg for item in target for arg in ("--set", item)]]) == 0
    assert "name: x" in capsys.readouterr().out
    assert main(["config", str(TINY), "--set", "gate.floor=1"]) == 2
    assert "gate.floor (from --set): unknown field" in capsys.readouterr().err
    by_hand = "serving.extra_args=[--tokenizer-metrics-allowed-custom-labels, eagle3, app]"  # the launcher's flag
    assert main(["config", str(KIMI), "--set", by_hand]) == 2
    assert "repeats --tokenizer-metrics-allowed-custom-labels" in capsys.readouterr().err


def test_online_sglang_features_stay_on_one_node():
    with pytest.raises(ConfigError, match="training.nnodes 2 would split it across nodes"):
        load_config(KIMI, ["training.nnodes=2", "training.launcher=srun", "training.rdzv_endpoint=node-1:29500",
                           "training.batch_size=32"])
    assert load_config(KIMI, ["training.nnodes=2", "training.launcher=srun", "training.rdzv_endpoint=node-1:29500",
                              "training.features=offline", "training.batch_size=32"]).training.nnodes == 2


def test_the_global_batch_must_split_into_micro_batches_over_the_ranks():
    """training.batch_size / (nproc_per_node x nnodes x micro_batch_size) micro-batches per step, a whole number."""
    with pytest.raises(ConfigError, match=r"training.batch_size 8 must be a multiple of the 8 ranks \(training.nproc_per_node "
                       r"x nnodes\) x training.micro_batch_size 2 = 16: set it to 16 or lower training.micro_batch_size"):
        load_config(KIMI, ["training.batch_size=8", "training.micro_batch_size=2"])
    with pytest.raises(ConfigError, match=r"training.batch_size 12 must be a multiple of the 8 ranks .* = 8: set it to 16$"):
        load_config(KIMI, ["training.batch_size=12", "training.micro_batch_size=1"])  # lowering it cannot help
    with pytest.raises(ConfigError, match=r"training.batch_size 16 must be a multiple of the 3 ranks \(training.nproc_per_node "
                       r"x nnodes\): set it to 15$"):
        load_config(TINY, ["training.nproc_per_node=3"])  # no micro_batch_size: each rank's share at once
    with pytest.raises(ConfigError, match=r"training.micro_batch_size \(from --set\): Input should be greater than 0"):
        load_config(KIMI, ["training.micro_batch_size=0"])
    config = load_config(KIMI, ["training.batch_size=64"])
    assert config.training.sequences_per_forward(8) == 2  # 4 micro-batches of 2 sequences per GPU
    assert load_config(TINY, []).training.sequences_per_forward(2) == 8  # the whole share of 16 over 2 ranks


def test_the_resolved_config_reloads_as_the_same_config_and_checks_the_targets_facts(tmp_path, micro_target):
    config = load_config(TINY, [f"run.dir={tmp_path}", f"target.path={micro_target}", "target.hidden_size=64",
                                "target.vocab_size=512", "vocab.draft_vocab_size=128"])
    path = resolved_config_file(config)
    assert path == tmp_path / "config.resolved.yaml" and load_config(path) == config
    assert "aux_layers:\n  - 0\n  - 1\n  - 2" in path.read_text()  # defaults and derived values written out
    wrong = config.model_copy(update={"target": config.target.model_copy(update={"hidden_size": 128})})
    with pytest.raises(ConfigError, match=f"target.hidden_size is 128 but {micro_target}/config.json says 64"):
        resolved_config_file(wrong)


def test_a_missing_target_directory_stops_eagle3_run_in_one_line_before_prefect(tmp_path):
    """No model-hub error for a local path, and no Prefect server touched: its database is never created."""
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect")}
    result = subprocess.run([sys.executable, "-m", "flows.run", str(TINY), "--set", "target.path=/no/such/dir"],
                            capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "target.path /no/such/dir: no model directory there" in result.stderr
    assert "eagle3 make-tiny-target /no/such/dir" in result.stderr and "Repo id" not in result.stderr
    assert not (tmp_path / "prefect").exists() or not list((tmp_path / "prefect").glob("*.db"))


@pytest.mark.parametrize("change, message", [
    (lambda target, tmp: (target / "tokenizer.json").unlink() or (target / "tokenizer_config.json").unlink(),
     "no tokenizer there"),
    (lambda target, tmp: None, "data.prompts {tmp}/none.jsonl: no such file"),
    (lambda target, tmp: (tmp / "file").write_text("x"), "registry.path {tmp}/file/registry: {tmp}/file is not a writable"),
])
def test_local_inputs_are_checked_naming_the_field_and_the_fix(micro_target, tmp_path, change, message):
    target = tmp_path / "target"
    shutil.copytree(micro_target, target)
    overrides = [f"target.path={target}", "target.hidden_size=64", "target.vocab_size=512", "vocab.draft_vocab_size=128",
                 f"registry.path={tmp_path / 'registry'}"]
    if "prompts" in message:
        overrides.append(f"data.prompts={tmp_path / 'none.jsonl'}")
    if "registry" in message:
        overrides.append(f"registry.path={tmp_path / 'file' / 'registry'}")
    change(target, tmp_path)
    with pytest.raises(ConfigError, match=re.escape(message.format(tmp=tmp_path))):
        check_local_inputs(load_config(TINY, overrides))


def test_a_target_only_on_the_gpu_node_is_declared_by_its_config_file():
    check_local_inputs(load_config(KIMI))  # /models/Kimi-K2.5 is not here; target.config_file says what it is


MLA_DRAFT = Path(__file__).parent.parent / "configs" / "tiny-deepseek-v2-mla-cpu.yaml"


@pytest.mark.parametrize(("overrides", "message"), [
    (["serving.release=0.5.11"], "SGLang 0.5.11 is not among the releases read that have Eagle3DeepseekV2ForCausalLM "
                                 "(0.5.12, 0.5.13–0.5.23)"),
    (["serving.release=0.5.12", "draft.fc_norm=true"], "fc_norm, which SGLang 0.5.12 does not implement (served from "
                                                       "0.5.13)"),
    (["draft.norm_before_fc=true"], "SGLang's MLA draft (Eagle3DeepseekV2ForCausalLM) has no input norm"),
    (["draft.q_lora_rank=null"], "draft.attention mla needs draft.q_lora_rank"),
    (["draft.attention=mha", "draft.num_key_value_heads=2"], "describe an MLA draft: set draft.attention mla or remove them"),
    (["draft.norm_before_residual=true"], "draft.norm_before_residual: no SGLang release implements it"),
])
def test_a_draft_form_the_served_release_cannot_build_is_refused_at_load(overrides, message):
    with pytest.raises(ConfigError) as refused:
        load_config(MLA_DRAFT, overrides)
    assert message in str(refused.value) and len(str(refused.value).splitlines()) == 1


def test_a_derived_config_is_validated_as_a_loaded_one(tmp_path):
    """Sweep points, production's endpoint, the chosen recompute: every copy with changes passes the config's checks."""
    config = load_config(TINY)
    copy = derived(config, {"serving.port": 1234, "training.recompute": "none"})
    assert (copy.serving.port, copy.training.recompute, copy.serving.num_steps) == (1234, "none", config.serving.num_steps)
    assert config.serving.port != 1234  # the original is left as it was
    with pytest.raises(ConfigError, match=r"serving.num_steps: Input should be greater than or equal to 1 \(got 0\)"):
        derived(config, {"serving.num_steps": 0})
    with pytest.raises(ConfigError, match="serving.nope: unknown field; allowed here: context_length"):
        derived(config, {"serving.nope": 1})
    with pytest.raises(ConfigError, match="monitoring.window: the config has no monitoring section to change"):
        derived(config, {"monitoring.window": 1})


def test_a_config_written_with_the_old_field_names_loads_the_same_and_names_the_new_ones(tmp_path, capsys):
    """data.engine is data.generator, data.capture_engine data.feature_backend ("engine" means a serving engine only):
    a file or --set with the old names means what it meant, saying the new name once per field."""
    old = tmp_path / "old.yaml"
    old.write_text(f"extends: {TINY}\ndata:\n  engine: local\n  capture_engine: local\n")
    config = load_config(old, ["data.engine=local"])
    assert config.data == load_config(TINY).data
    err = capsys.readouterr().err
    assert f"{old}: data.engine is now data.generator (the old name still works; write the new one)" in err
    assert f"{old}: data.capture_engine is now data.feature_backend" in err
    assert "--set: data.engine is now data.generator" in err
    both = tmp_path / "both.yaml"
    both.write_text(f"extends: {TINY}\ndata:\n  engine: local\n  generator: local\n")
    with pytest.raises(ConfigError, match="data.engine is the old name of data.generator, and both are given: keep "
                                          "data.generator"):
        load_config(both)


def test_a_feature_backend_is_one_of_the_registry_named_with_the_registered_ones():
    with pytest.raises(ConfigError, match=r"data.feature_backend \(from --set\): 'vllm' is not registered; give 'local' "
                                          r"or 'sglang' \(see docs/data.md\)"):
        load_config(TINY, ["data.feature_backend=vllm"])
