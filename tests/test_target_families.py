"""Target families at config load: the shipped family configs, the refusals of what the export cannot serve (or would
serve on other features than the draft trains on), and tiny targets of every family (conformance/test_families.py
runs SGLang's own model files on them)."""

from __future__ import annotations

import pytest

from eagle3.config import check_target_facts
from eagle3.resolve import load_config
from eagle3.runtime.tiny import FAMILY_ARCHITECTURES, MICRO, of_family
from eagle3.errors import ConfigError, Eagle3Error
from eagle3.target.info import read_target_info
from family_targets import (CONTENDERS_CONFIG, DFLASH_CONFIG, DSPARK_CONFIG, FAMILIES, FAMILY_CONFIGS, MLA_DRAFT_CONFIG,
                            STREAMED_CONFIG, THREE_KINDS_CONFIG, VLLM_CONFIG, build_family_target)
from helpers import ROOT, TINY



@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_ships_a_config_on_its_own_target_registry_and_production(family):
    config, default = load_config(FAMILY_CONFIGS[family]), load_config(TINY)
    assert config.target.family == family
    assert config.target.path == f"runs/targets/tiny-{family.replace('_', '-')}"
    assert config.registry.path != default.registry.path
    assert config.production.state_dir != default.production.state_dir
    assert config.training == default.training and config.data.prompts == default.data.prompts  # the rest: tiny-cpu's


@pytest.mark.parametrize("family", FAMILIES)
def test_a_target_of_each_family_is_read_as_that_family(family, tmp_path):
    target = build_family_target(tmp_path / family, family)
    assert read_target_info(target).family == family
    config = load_config(FAMILY_CONFIGS[family], [f"target.path={target}", "target.hidden_size=64",
                                                  "target.vocab_size=512", "target.num_hidden_layers=5",
                                                  "data.aux_layers=[1, 2, 3]", "vocab.draft_vocab_size=256"])
    check_target_facts(config)  # the architecture in config.json names the configured family
    wrong = "qwen2" if family != "qwen2" else "qwen3"
    with pytest.raises(ConfigError, match=f"target.family is {wrong} but .* SGLang serves with its {family} model"):
        check_target_facts(config.model_copy(update={"target": config.target.model_copy(update={"family": wrong})}))


def test_gemma3_on_a_release_that_captures_the_branch_alone_is_refused_at_load_in_one_line():
    with pytest.raises(ConfigError) as refused:
        load_config(FAMILY_CONFIGS["gemma3"], ["serving.release=0.5.23"])
    message = str(refused.value)
    assert "\n" not in message
    for part in ("target.family gemma3", "0.5.23", "feed-forward branch", "0.5.12–0.5.16", "data.feature_backend"):
        assert part in message


def test_gemma3_without_a_release_is_refused_because_the_releases_disagree():
    with pytest.raises(ConfigError, match="serving.release .not given.*0.5.17–0.5.23.*name it in serving.release"):
        load_config(FAMILY_CONFIGS["gemma3"], ["serving.release=null"])


def test_features_captured_through_sglang_are_what_that_release_serves():
    config = load_config(FAMILY_CONFIGS["gemma3"], ["serving.release=0.5.23", "data.feature_backend=sglang"])
    assert config.data.feature_backend == "sglang"


@pytest.mark.parametrize("family, release, reason", [
    ("gemma3", "0.5.11", "'gemma3' on SGLang 0.5.11 is not in the aux-id table"),
    ("mistral", "0.5.13", "model file 'mistral' is not in the aux-id table .known: .*qwen3_moe"),
    ("qwen3", "0.5.24", "'qwen3' on SGLang 0.5.24 is not in the aux-id table"),
])
def test_a_family_or_release_the_export_cannot_serve_is_refused_before_any_data(family, release, reason):
    with pytest.raises(ConfigError, match=f"target.family {family} on serving.release {release} cannot be served: "
                       f"{reason}"):
        load_config(TINY, [f"target.family={family}", f"serving.release={release}"])


def test_a_config_extends_another_field_by_field(tmp_path):
    (tmp_path / "base.yaml").write_text(TINY.read_text())
    child = tmp_path / "child.yaml"
    child.write_text("extends: base.yaml\nserving:\n  num_steps: 2\nrun:\n  name: child\n")
    config = load_config(child)
    assert (config.serving.num_steps, config.run.name) == (2, "child")
    assert config.serving.release == load_config(TINY).serving.release  # the base's other serving fields stay


def test_a_config_extending_itself_in_a_loop_is_refused(tmp_path):
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(ConfigError, match="extends a.yaml, which extends b.yaml again"):
        load_config(tmp_path / "a.yaml")


def test_tiny_targets_come_in_every_family_the_table_serves_from_the_tiny_table():
    assert set(FAMILY_ARCHITECTURES) == {"llama", *FAMILIES}
    assert of_family(MICRO, "qwen3_moe").name == "micro-qwen3-moe"
    with pytest.raises(Eagle3Error, match="no tiny target of family 'mistral'"):
        of_family(MICRO, "mistral")


def test_the_shipped_family_configs_are_all_tested():
    shipped = {path for path in (ROOT / "configs").glob("tiny-*-cpu.yaml")}
    assert shipped == {*FAMILY_CONFIGS.values(), MLA_DRAFT_CONFIG, DFLASH_CONFIG, DSPARK_CONFIG, CONTENDERS_CONFIG,
                       THREE_KINDS_CONFIG, VLLM_CONFIG, STREAMED_CONFIG}

