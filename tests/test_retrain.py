"""A retrain for every kind of draft (docs/production-loop.md, "Retraining"): a production of the run's kind is the
warm start of `eagle3 run --mode retrain` (the log names the version, the retrained draft's checkpoint and version
record it), a draft of another kind is refused as a warm start before any stage and a production of another kind
makes the retrain train from scratch, saying so. DFlash's and DSpark's productions each (EAGLE-3's retrain is
test_deployment_e2e's)."""

import json

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
from prefect.logging.handlers import APILogHandler

from eagle3.algorithms.dflash.model import DFlashConfig
from eagle3.algorithms.dflash.warm_start import carry_over_problem
from eagle3.resolve import load_config
from eagle3.deployment.promotion import retrain_overrides
from eagle3.errors import Eagle3Error
from eagle3.init_draft import init_draft
from eagle3.records.manifest import read_manifest
from eagle3.registry.registry import open_registry, version_algorithm
from eagle3.runs import retrain_runs
from eagle3.train.trainer import best_draft
from family_targets import DFLASH_CONFIG, DSPARK_CONFIG
from flows.eagle3 import eagle3
from helpers import TINY, micro_run_overrides

pytestmark = pytest.mark.usefixtures("one_thread")
PAD = 5  # the tiny tokenizers' <|pad|>: never generated
DFLASH_MICRO = ["draft.dflash.num_layers=1", f"draft.dflash.mask_token_id={PAD}", "sweep.points=[[1, 1, 2]]"]
# a DSpark draft is served only as the chain of its gamma: no sweep point of another shape
DSPARK_MICRO = ["draft.dspark.num_layers=1", f"draft.dspark.mask_token_id={PAD}", "sweep.points=[]"]
KINDS = {"dflash": (DFLASH_CONFIG, DFLASH_MICRO), "dspark": (DSPARK_CONFIG, DSPARK_MICRO)}


def flow_logs(state) -> list[str]:
    APILogHandler().flush()  # the run's last lines are shipped in the background: wait for them
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[state.state_details.flow_run_id])))
    return [entry.message for entry in logs]


@pytest.fixture(scope="module", params=list(KINDS))
def production(request, prefect_api, tmp_path_factory, micro_target):
    """The kind's tiny config (configs/tiny-dflash-cpu.yaml, configs/tiny-dspark-cpu.yaml) on the micro target, run
    once: its draft promoted into production. -> (kind, config path, config, the micro run's overrides, the kind's,
    the production version)."""
    kind = request.param
    path, extra = KINDS[kind]
    run_dir = tmp_path_factory.mktemp(f"{kind}-production")
    micro = micro_run_overrides(run_dir, micro_target)
    state = eagle3(str(path), micro + extra, return_state=True)
    assert state.is_completed() and state.name == "Completed", state.message
    return kind, path, load_config(path, micro + extra), micro, extra, state.result()


def test_a_production_retrains_warm_from_its_own_version(production):
    kind, path, config, micro, extra, version = production
    overrides = micro + extra
    state = eagle3(str(path), overrides, mode="retrain", return_state=True)
    assert state.is_completed() and state.name in ("Completed", "RolledBack"), state.message
    logs = flow_logs(state)
    assert any(f"retrain: warm start from production version {version} (a {kind} draft)" in line
               for line in logs), logs
    assert any(line.startswith(f"train: warm start from {version} (version ") for line in logs), logs
    assert any(line.startswith("gate: promote: ") for line in logs), logs  # the retrained draft was promoted
    (retrain,) = retrain_runs(config.run.dir)
    started_from = read_manifest(best_draft(load_config(path, [*overrides, f"run.dir={retrain}"]).run))
    assert started_from["init_from"]["init_from"] == version and started_from["init_from"]["kind"] == "version"
    registry = open_registry(config.registry)
    if state.name == "Completed":  # promoted: the new version names the draft it was fine-tuned from
        new = registry.production_version()
        assert new != version and version_algorithm(registry.manifest(new)) == kind
        assert registry.manifest(new)["lineage"]["init_from"]["init_from"] == version
    else:  # rolled back: production keeps serving the version the retrain started from
        assert registry.production_version() == version


def test_an_eagle3_run_trains_from_scratch_over_another_kinds_production_and_refuses_it_as_a_warm_start(production):
    kind, _, config, micro, _, _ = production
    registry = open_registry(config.registry)
    version = registry.production_version()  # the fixture's, or a retrain's of it
    lines = []
    added = retrain_overrides(load_config(TINY, micro).run, "eagle3", registry, log=lines.append)
    assert not any(o.startswith("training.init_from") for o in added)
    assert lines == [f"retrain: production {version} is a {kind} draft, which draft.algorithm eagle3 does not warm "
                     f"start from: training from scratch in {added[0].removeprefix('run.dir=')}"]
    by_hand = load_config(TINY, [*micro, f"training.init_from={json.dumps(version)}"])
    with pytest.raises(Eagle3Error, match=f"training.init_from '{version}' .*: it is a {kind} draft, and "
                                          "draft.algorithm eagle3 warm starts only from eagle3 drafts; name one"):
        init_draft(by_hand.training, by_hand.draft, by_hand.registry)


def test_a_dflash_warm_start_carries_over_only_weights_that_compute_the_same(tmp_path):
    ours = DFlashConfig(hidden_size=32, target_hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
                        rope_theta=10000.0, max_position_embeddings=256, vocab_size=40, draft_vocab_size=16,
                        torch_dtype="float32", aux_layers=[1], target_num_hidden_layers=4, block_size=4,
                        mask_token_id=PAD)
    # the vocab map, the block, the dtype and serving's reach may change
    assert carry_over_problem(ours.model_copy(update={"draft_vocab_size": 20, "block_size": 8,
                                                      "torch_dtype": "bfloat16", "max_position_embeddings": 512}),
                              ours) is None
    assert "mask_token_id 6 in the init draft, 5 in this config" in carry_over_problem(
        ours.model_copy(update={"mask_token_id": 6}), ours)
    assert "target layers [2] (aux_layers), this run's data on layers [1]" in carry_over_problem(
        ours.model_copy(update={"aux_layers": [2]}), ours)
    assert "num_hidden_layers 1 in the init draft, 2 in this config" in carry_over_problem(
        ours.model_copy(update={"num_hidden_layers": 1}), ours)
