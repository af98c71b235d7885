"""`eagle3 plan`: the per-GPU memory of each GPU stage, and the refusal of a config that does not fit."""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eagle3 import cli
from eagle3.resolve import load_config
from eagle3.errors import ConfigError
from eagle3.procs import LaunchError
from eagle3.serving import serving_engine
from eagle3.serving.base import launch_spec
from eagle3.target.info import active_parameters, read_target_size
from eagle3.model.teacher import TeacherHead
from eagle3.model.blocks import LossRows
from eagle3.algorithms.eagle3.ttt import TTTModel
from eagle3.plan import chosen_recompute, plan_memory, require_fit, target_size
from eagle3.plan_time import WARM_STEP_RATIO, Scenario, plan_time
from eagle3.algorithms.eagle3 import EAGLE3
from eagle3.train.memory import AllocationPeak, training_step_peak_by_op, training_step_peak_bytes
from helpers import TINY, micro_overrides, tiny_draft

KIMI = Path(__file__).parent.parent / "configs" / "kimi-k25-8xh200.yaml"
STEP = "training step, measured (7 predictions a position: activations, teacher, gradients)"
# 1 TB per GPU (a longer seq_len costs the dry run minutes); recomputing, so that one dry run sizes it
TOO_BIG = ["training.batch_size=512", "training.micro_batch_size=64", "training.recompute=norms_mlp"]


def test_the_kimi_config_fits_the_node(capsys):
    assert cli.main(["plan", str(KIMI), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] is True and plan["gpu_memory_gib"] == 141
    stages = {stage["name"]: stage for stage in plan["stages"]}
    assert list(stages) == ["regenerate", "capture", "train", "serve"]
    for stage in stages.values():
        assert stage["fits"] is True and 0 < stage["per_gpu_gib"] <= 141 and stage["gpus"] == 8
    assert stages["serve"]["parts"]["target weights (/8)"] == pytest.approx(553.39 / 8, rel=1e-3)
    # online: no hidden state on disk, and the target's eighth (plus KV and SGLang's pool) beside the draft's step
    assert plan["training_features"] == "online" and plan["storage_bytes"]["hidden_states"] == 0
    assert stages["train"]["parts"]["target weights (/8)"] == pytest.approx(553.39 / 8, rel=1e-3)
    assert stages["train"]["parts"]["KV cache, 65,536 tokens"] > 0  # one global micro-batch: 8 GPUs x 2 x 4,096
    # training.recompute auto: the step fits the H200 keeping every intermediate, so nothing is recomputed
    assert plan["recompute"].startswith("training.recompute auto -> none: the step fits without recomputing")
    assert stages["train"]["per_gpu_gib"] <= 141 - 10
    # issue 28: the draft's step at TTT 7 on the config's 2 sequences of 4,096 tokens per forward when recomputing,
    # where it goes, and on one sequence (27.6 GiB before)
    lean = plan_memory(load_config(KIMI, ["training.recompute=norms_mlp"])).to_dict()["stages"][2]
    step = lean["parts"][STEP]
    assert step <= 2 * 14 and sum(lean["step_by_op_gib"].values()) == pytest.approx(step, abs=0.1)
    assert step < stages["train"]["parts"][STEP] and lean["per_gpu_gib"] <= 120.7
    one = plan_memory(load_config(KIMI, ["training.micro_batch_size=1", "training.recompute=norms_mlp"]))
    assert one.stages[2].parts[STEP] <= 14


def test_offline_training_stores_the_hidden_states_and_frees_the_training_gpus():
    online, offline = (plan_memory(load_config(KIMI, [f"training.features={mode}"])) for mode in ("online", "offline"))
    assert offline.storage["hidden_states"] == 200_000 * 4096 * (4 * 7168 * 2 + 5)  # 47 TB at most
    assert online.storage["hidden_states"] == 0 and online.storage["heldout_features"] < 1e11
    train = {plan.features: plan.stages[2] for plan in (online, offline)}
    assert "target weights (/8)" not in train["offline"].parts
    assert train["online"].per_gpu_gib - train["offline"].per_gpu_gib > 553.39 / 8


def test_a_config_that_does_not_fit_is_refused_in_one_line_naming_stage_and_knob(capsys):
    args = [arg for item in TOO_BIG for arg in ("--set", item)]
    assert cli.main(["plan", str(KIMI), *args, "--json"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "train needs" in err and "node.gpu_memory_gib 141" in err and "training.micro_batch_size (64 sequences per GPU per forward" in err
    assert "or training.features offline" in err
    assert cli.main(["config", str(KIMI), *args]) == 2  # `eagle3 config` refuses it too, before printing anything
    captured = capsys.readouterr()
    assert captured.out == "" and "train needs" in captured.err and len(captured.err.strip().splitlines()) == 1
    with pytest.raises(ConfigError, match="train needs .* lower training.micro_batch_size"):  # the flow's load-config
        require_fit(load_config(KIMI, TOO_BIG), KIMI)


def test_the_training_stage_grows_with_the_sequences_per_forward_and_lists_its_parts():
    def train_stage(*overrides):
        plan = plan_memory(load_config(KIMI, ["training.features=offline", *overrides]))
        return plan, plan.stages[2]
    small_plan, small = train_stage("training.batch_size=8", "training.micro_batch_size=1", "training.recompute=norms_mlp")
    large_plan, large = train_stage("training.batch_size=128", "training.micro_batch_size=16",
                                    "training.recompute=norms_mlp")
    step = STEP
    # 16 vs 1 sequence; one set of the weights' bf16 copies (the peak comes in the forward, before any gradient)
    assert 13 * small.parts[step] < large.parts[step] < 16 * small.parts[step]
    assert small_plan.fits(small) is True and large_plan.fits(large) is False
    assert large_plan.refusals() == [f"train needs {large.per_gpu_gib:.1f} GiB per GPU, over node.gpu_memory_gib 141: "
                                     "lower training.micro_batch_size (16 sequences per GPU per forward now) or "
                                     "lower training.seq_len (4096)"]
    # the global batch sets how many micro-batches a step runs, not their memory
    assert train_stage("training.batch_size=128", "training.micro_batch_size=1",
                       "training.recompute=norms_mlp")[1].parts == small.parts
    _, whole_share = train_stage("training.batch_size=128", "training.micro_batch_size=null",  # 16 per GPU at once
                                 "training.recompute=norms_mlp")
    assert whole_share.parts == large.parts and whole_share.knob.startswith(
        "set training.micro_batch_size under the 16 sequences per GPU per forward now (each rank's share of "
        "training.batch_size) or lower training.seq_len (4096)")


def test_kimi_weights_are_estimated_from_its_config():
    size = read_target_size(Path(__file__).parent.parent / "configs" / "targets" / "kimi-k25.json")
    assert size.num_parameters == pytest.approx(1.03e12, rel=0.01)  # 1 T total, routed experts INT4 in groups of 32
    assert size.weight_bytes / 2**30 == pytest.approx(553, rel=0.01)  # ~595 GB on disk
    assert size.kv_bytes_per_token == (512 + 64) * 61 * 2 and not size.kv_split_by_tp  # MLA's latent, every TP rank


def test_a_target_on_disk_is_sized_from_its_files(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 4, "hidden_size": 64, "vocab_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2}))
    save_file({"w": torch.zeros(1000)}, tmp_path / "model.safetensors")
    size = read_target_size(tmp_path)
    assert size.weight_bytes == (tmp_path / "model.safetensors").stat().st_size and size.weights_from == "safetensors files"
    assert size.kv_bytes_per_token == 2 * 2 * 16 * 4 * 2 and size.kv_split_by_tp


def test_a_missing_target_leaves_its_stages_unknown_not_fitting():
    plan = plan_memory(load_config(TINY, ["target.path=/nonexistent/target"]))
    assert [stage.name for stage in plan.stages if stage.unknown] == ["regenerate", "capture", "serve"]
    assert plan.all_fit and plan.fits(plan.stages[2]) is True


def tiny_step():
    """(draft, teacher head, aux, last, ids, loss rows): a step of 2 x 24 tokens, TTT 3, on a tiny draft."""
    model = tiny_draft(vocab=40, draft_vocab=16)
    head = TeacherHead(torch.randn(40, 32).bfloat16(), torch.arange(16))
    aux, last = torch.randn(2, 24, 96), torch.randn(2, 24, 32)
    ids, mask = torch.randint(0, 40, (2, 24)), torch.ones(2, 24, dtype=torch.long)
    return model, head, aux, last, ids, LossRows.of(mask, 3)


def test_the_dry_run_counts_what_the_real_step_allocates():
    """Storage-less tensors take the same kernels and sizes as real ones: the counts agree exactly."""
    model, head, aux, last, ids, rows = tiny_step()
    with AllocationPeak() as real:
        teacher = head(last, rows.teacher)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            stats = TTTModel(model)(aux, ids, teacher, rows)
        stats[0].sum().backward()
    draft = load_config(TINY).draft
    assert training_step_peak_bytes(EAGLE3, model.config, draft, 2, 24, 3, pre_norm=False, recompute=True) == real.peak
    assert training_step_peak_by_op(EAGLE3, model.config, draft, 2, 24, 3, pre_norm=False, recompute=True) == real.peak_by_op
    assert sum(real.peak_by_op.values()) == real.peak and real.peak_by_op["mm"] > 0


def test_a_view_of_an_existing_weight_is_not_an_allocation():
    weight = torch.randn(1000, 100)
    with AllocationPeak() as tracker:
        weight[:10].sum()
    assert tracker.peak < 1000  # the slice shares the weight's 400 kB; only the scalar result is new


def test_the_serve_stage_counts_the_draft_in_its_own_dtype(micro_target, tmp_path):
    """configs/tiny-cpu.yaml serves a float32 draft: twice the bytes of a bf16 one, and named so."""
    parts = {}
    for dtype in ("float32", "bfloat16"):
        config = load_config(TINY, micro_overrides(tmp_path, micro_target) + [f"draft.torch_dtype={dtype}"])
        serve = next(s for s in plan_memory(config).stages if s.name == "serve")
        parts[dtype] = {name: gib for name, gib in serve.parts.items() if name.startswith("draft weights")}
    assert list(parts["float32"]) == ["draft weights, fp32 (/1)"] and list(parts["bfloat16"]) == ["draft weights, bf16 (/1)"]
    assert parts["float32"]["draft weights, fp32 (/1)"] == pytest.approx(2 * parts["bfloat16"]["draft weights, bf16 (/1)"], rel=0.01)


def kimi_hours(*overrides: str, retrain: bool = False, nodes: int = 1) -> dict:
    config = load_config(KIMI, list(overrides))
    return plan_time(config, *target_size(config.target), Scenario(retrain, nodes)).to_dict()  # no dry run of the step


def stage_hours(plan: dict) -> dict[str, float]:
    return {stage["name"]: stage["hours"] for stage in plan["stages"]}


def test_a_kimi_weekly_traffic_retrain_takes_the_stores_replies_and_trains_a_warm_budget_within_12_hours(capsys):
    first, retrain = kimi_hours(), kimi_hours(retrain=True)
    assert retrain["total_h"] <= 12 < first["total_h"]
    assert retrain["total_h"] < retrain["ceiling_h"] < first["total_h"] and first["ceiling_h"] is None
    assert retrain["reused"] == ["191,000 of data.num_samples 200,000 replies from the sample store; 9,000 new traffic "
                                 "prompts answered (data.traffic.share 0.3, at most max_prompts 10,000 less the held-out)"]
    regenerate = next(s for s in retrain["stages"] if s["name"] == "regenerate")["parts"]
    assert any(name.startswith("decode: 9,000 x data.max_new_tokens") for name in regenerate)
    train = next(s for s in retrain["stages"] if s["name"] == "train")["parts"]
    steps = math.ceil(WARM_STEP_RATIO * 10_000) + 3 * 250
    assert any(f"training.warm_steps auto: {steps:,} = {WARM_STEP_RATIO:g} (measured" in name for name in train)
    assert stage_hours(retrain)["train"] < steps / 10_000 * stage_hours(first)["train"] + 0.2  # the engine start
    serve = [next(s for s in plan["stages"] if s["name"] == "serve")["parts"] for plan in (first, retrain)]
    assert not any("production on data.traffic prompts" in name for name in serve[0])  # no production yet
    assert any("production on data.traffic prompts" in name for name in serve[1])
    no_traffic = kimi_hours("data.traffic=null", retrain=True)
    assert no_traffic["reused"][0].startswith("all 200,000 replies from the sample store")
    assert kimi_hours("data.share_samples=false", retrain=True)["reused"][0].startswith("nothing: no sample store")
    assert cli.main(["plan", str(KIMI)]) == 0
    out = capsys.readouterr().out
    assert "hours of a first run (from scratch) on 1 node(s)" in out and "hours of a retrain (warm start" in out
    assert f"retrain     {retrain['total_h']:8.2f} h  fits node.retrain_period_h 168 h" in out


def test_more_nodes_spread_regeneration_and_offline_training_but_not_sglangs_online_features(capsys):
    one, four = kimi_hours(), kimi_hours(nodes=4)
    decode = [next(h for name, h in next(s for s in plan["stages"] if s["name"] == "regenerate")["parts"].items()
                   if name.startswith("decode:")) for plan in (one, four)]
    assert decode[1] == pytest.approx(decode[0] / 4, rel=0.01)
    train = next(s for s in four["stages"] if s["name"] == "train")["parts"]
    assert any("on 1 node: features online through SGLang's runner span one node's world" in name for name in train)
    assert stage_hours(four)["train"] == stage_hours(one)["train"]
    offline = ("training.features=offline", "data.feature_backend=local")
    spread = [stage_hours(kimi_hours(*offline, nodes=n))["train"] for n in (1, 4)]
    assert spread[1] == pytest.approx(spread[0] / 4, rel=0.02)
    assert cli.main(["plan", str(KIMI), "--nodes", "4", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["hours"]["nodes"] == plan["retrain_hours"]["nodes"] == 4
    with pytest.raises(SystemExit):
        cli.main(["plan", str(KIMI), "--nodes", "0"])
    assert "'0': give a whole number of nodes, 1 or more" in capsys.readouterr().err


def test_the_kimi_plan_gives_hours_per_stage_with_its_assumptions_and_their_fields(capsys):
    assert cli.main(["plan", str(KIMI)]) == 0
    out = capsys.readouterr().out
    for shown in ("989 TFLOP/s per GPU (node.peak_tflops)", "4.8 TB/s (node.hbm_tbps)",
                  "MFU decode 0.2, prefill 0.35, train 0.3 (node.mfu.decode / prefill / train)",
                  "10 min per server start (node.model_load_min)", "data.num_samples 200,000", "data.concurrency",
                  "training.max_steps 10,000 x batch_size 32 x seq_len 4,096", "HBM-bound", "fits node.retrain_period_h 168 h"):
        assert shown in out
    hours = kimi_hours()
    stages = {stage["name"]: stage["hours"] for stage in hours["stages"]}
    assert list(stages) == ["regenerate", "capture", "train", "serve", "sweep", "deploy"]
    assert all(h > 0 for h in stages.values()) and hours["total_h"] == pytest.approx(sum(stages.values()), abs=0.02)
    assert 10 < stages["train"] < 30 and 10 < stages["regenerate"] < 40  # a week holds a retrain several times over
    # 8 of 384 routed experts per token: ~32 B of Kimi's ~1 T parameters multiply each token
    assert hours["figures"]["target active parameters"] == pytest.approx(32e9, rel=0.03)


def test_the_hours_count_optimizer_steps_times_the_global_batch_whatever_its_micro_batches():
    def train_hours(*overrides: str) -> dict:
        return next(s for s in kimi_hours(*overrides)["stages"] if s["name"] == "train")["parts"]
    by_one, by_eight = train_hours("training.batch_size=64"), train_hours("training.batch_size=64",
                                                                            "training.micro_batch_size=8")
    assert by_one == by_eight
    draft = next(name for name in by_one if name.startswith("draft:"))
    assert "batch_size 64" in draft and by_one[draft] == pytest.approx(2 * next(
        h for name, h in train_hours().items() if name.startswith("draft:")), rel=1e-3)  # 2x the sequences of batch 32


def test_hours_scale_inversely_with_the_assumed_mfu():
    def draft_hours(mfu: float) -> float:
        train = next(s for s in kimi_hours(f"node.mfu.train={mfu}")["stages"] if s["name"] == "train")
        return next(h for name, h in train["parts"].items() if name.startswith("draft:"))
    assert draft_hours(0.15) == pytest.approx(2 * draft_hours(0.3), rel=1e-3)
    regenerate = {mfu: next(s for s in kimi_hours(f"node.mfu.prefill={mfu}")["stages"] if s["name"] == "regenerate")
                  for mfu in (0.35, 0.7)}
    prompts = [next(h for name, h in s["parts"].items() if name.startswith("prompts:")) for s in regenerate.values()]
    assert prompts[0] == pytest.approx(2 * prompts[1], rel=1e-3) and prompts[0] > 1  # hours, not rounding noise


def test_decode_takes_the_slower_of_the_flop_and_the_bandwidth_bound():
    def regenerate(*overrides: str) -> float:
        return next(s for s in kimi_hours(*overrides)["stages"] if s["name"] == "regenerate")
    hbm = regenerate()
    assert any("HBM-bound" in name for name in hbm["parts"])
    flop = regenerate("node.mfu.decode=0.01")  # 20x less compute per step: now the FLOPs bound decode
    assert any("FLOP-bound" in name for name in flop["parts"]) and flop["hours"] > hbm["hours"]
    faster = regenerate("node.hbm_tbps=9.6")
    assert faster["hours"] < hbm["hours"]


def test_the_retrain_fits_its_period_or_says_it_does_not(capsys):
    weekly = kimi_hours()
    assert weekly["fits_period"] is True and weekly["retrain_period_h"] == 168
    daily = kimi_hours("node.retrain_period_h=4")
    assert daily["total_h"] > 4 and daily["fits_period"] is False
    assert cli.main(["plan", str(KIMI), "--set", "node.retrain_period_h=4", "--json"]) == 0  # memory still fits
    plan = json.loads(capsys.readouterr().out)
    assert {"assumptions", "figures", "stages", "total_h", "retrain_period_h", "fits_period"} <= set(plan["retrain_hours"])
    assert plan["retrain_hours"]["fits_period"] is False and plan["hours"]["figures"]["node.peak_tflops"] == 989
    cli.main(["plan", str(KIMI), "--set", "node.retrain_period_h=4"])
    assert "DOES NOT FIT node.retrain_period_h 4 h" in capsys.readouterr().out


def test_a_dense_target_multiplies_every_parameter_but_its_input_embedding():
    text = {"num_hidden_layers": 4, "hidden_size": 64, "vocab_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2}
    layer = (2 * 64 * 4 * 16 + 2 * 64 * 2 * 16) + 3 * 64 * 256  # attention (GQA) + MLP at intermediate 4 x hidden
    assert active_parameters(text) == (4 * layer + 512 * 64, 4 * layer + 2 * 512 * 64)
    assert active_parameters({**text, "tie_word_embeddings": True}) == (4 * layer + 512 * 64,) * 2  # the head multiplies


def test_auto_recompute_keeps_every_intermediate_where_the_step_fits_and_recomputes_where_it_does_not():
    roomy = plan_memory(load_config(TINY))
    assert roomy.recompute.startswith("training.recompute auto -> none: the step fits without recomputing")
    assert roomy.all_fit
    tight = plan_memory(load_config(TINY, ["node.gpu_memory_gib=5.22"]))  # between the two steps' stages (5.20, 5.24)
    assert tight.recompute.startswith("training.recompute auto -> norms_mlp: without recomputing the step needs 5.2")
    assert tight.all_fit and tight.stages[2].parts[STEP.replace("7", "4")] < roomy.stages[2].parts[STEP.replace("7", "4")]
    assert chosen_recompute(load_config(TINY, ["training.recompute=norms_mlp"]))[0].training.recompute == "norms_mlp"


def test_recomputing_changes_the_memory_not_the_gradients():
    model, head, aux, last, ids, rows = tiny_step()
    grads = []
    for recompute in (True, False):
        model.set_recompute(recompute)
        model.zero_grad()
        TTTModel(model)(aux, ids, head(last, rows.teacher), rows)[0].sum().backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    lean, kept = (training_step_peak_bytes(EAGLE3, model.config, load_config(TINY).draft, 2, 24, 3, pre_norm=False,
                                            recompute=r) for r in (True, False))
    assert lean < kept


def test_the_kimi_mla_draft_fits_the_node_at_one_sequence_per_forward():
    plan = plan_memory(load_config(KIMI.with_name("kimi-k25-mla-8xh200.yaml")))
    assert plan.all_fit and plan.recompute.startswith("training.recompute auto -> none")
    train, serve = plan.stages[2], plan.stages[3]
    assert train.per_gpu_gib <= 141 - 10 and serve.parts["draft KV cache"] < 0.2  # one 576-wide latent per token


STREAMED = KIMI.with_name("kimi-k25-streamed-8xh200.yaml")
K3 = KIMI.with_name("kimi-k3-streamed-8xh200.yaml")


def streamed_hours(path: Path, nodes: int, capture_nodes: int | None = None) -> dict:
    """The first run's and the retrain's hours (False, True) on `nodes`, the capture nodes chosen as the plan does."""
    plan = plan_memory(load_config(path), nodes, capture_nodes)
    return {False: plan.time.to_dict(), True: plan.retrain.to_dict()}


def test_a_streamed_kimi_run_splits_four_nodes_and_its_trainers_hold_no_target(capsys):
    assert cli.main(["plan", str(STREAMED), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    stages = {stage["name"]: stage for stage in plan["stages"]}
    assert plan["fits"] is True and list(stages) == ["regenerate", "capture", "train", "capture worker", "serve"]
    assert not any(name.startswith("target weights") for name in stages["train"]["parts"])
    assert stages["capture worker"]["parts"]["target weights (/8)"] == pytest.approx(553.39 / 8, rel=1e-3)
    assert stages["train"]["gpus"] == 16 and stages["train"]["per_gpu_gib"] < 141 - 553.39 / 8
    first, retrain = plan["hours"], plan["retrain_hours"]
    assert first["nodes"] == retrain["nodes"] == 4 and first["capture_nodes"] == retrain["capture_nodes"] == 2
    stream = retrain["stream"]
    assert stream["bytes_per_token"] == 57_344 and stream["bytes_per_sample"] == 57_344 * 4096
    assert stream["high_watermark_samples"] == 400 * 2**30 // (57_344 * 4096) == 1828
    assert stream["capture_node_egress_gb_per_s"] == stream["trainer_node_ingress_gb_per_s"] == pytest.approx(
        stream["store_gb_per_s"] / 2, abs=0.01)
    # four nodes against the online config's one-node training: first run 22.86 -> 11.40 h, retrain 8.90 -> 3.64 h
    # (the goals: 12 h and 4 h), the serve and sweep stages measuring on the four nodes at once
    assert first["total_h"] <= 12 and retrain["total_h"] <= 4
    assert stage_hours(retrain)["train"] < 2 < stage_hours(kimi_hours(retrain=True, nodes=4))["train"] / 3


def test_measuring_servers_on_several_nodes_take_fewer_starts_one_after_another(capsys):
    spread = streamed_hours(STREAMED, 4)[True]
    serial = plan_memory(load_config(STREAMED, ["serving.nodes=[]"]), 4).retrain.to_dict()
    parts = {name: {part for part in stage["parts"]} for name, stage in
             (("spread", spread["stages"]), ("serial", serial["stages"])) for stage in stage if stage["name"] == "sweep"}
    assert any(p.startswith("10 server starts on 4 nodes at once (serving.nodes), 3 one after another") for p in parts["spread"])
    assert any(p.startswith("7 server starts: no draft + 6 of 6") for p in parts["serial"])
    serve = next(stage for stage in spread["stages"] if stage["name"] == "serve")
    assert any("production on data.traffic prompts beside them on a second node" in p for p in serve["parts"])
    # without serving.nodes the plan says what they would save, in the figures it plans with them
    [note] = serial["server_notes"]
    assert note.startswith("the serve and sweep stages' 10 server starts run one after another on serving.host: 1.83 h")
    assert note.endswith(f"serving.nodes listing 4 nodes measures on them at once: "
                         f"{stage_hours(spread)['serve'] + stage_hours(spread)['sweep']:.2f} h")
    assert serial["total_h"] - spread["total_h"] == pytest.approx(1.83 - float(note.split()[-2]), abs=0.02)
    assert "server_notes" not in spread and "server_notes" not in streamed_hours(STREAMED, 1)[True]


def test_the_plan_chooses_the_capture_nodes_or_takes_them_and_refuses_a_split_without_trainers(capsys):
    hours = {k: stage_hours(streamed_hours(STREAMED, 4, k)[False])["train"] for k in (1, 2, 3)}
    chosen = streamed_hours(STREAMED, 4)[False]
    assert chosen["capture_nodes"] == min(hours, key=hours.get) == 2 and stage_hours(chosen)["train"] == hours[2]
    assert streamed_hours(STREAMED, 4, 3)[True]["capture_nodes"] == 3
    assert streamed_hours(STREAMED, 8)[False]["capture_nodes"] == 5  # prefill costs ~1.4x the draft step: 5 of 8
    one = streamed_hours(STREAMED, 1)[False]  # the workers take turns with the trainers on the node's GPUs
    assert one["capture_nodes"] == 0 and any("in turn with their steps" in n for n in one["stages"][2]["parts"])
    assert cli.main(["plan", str(STREAMED), "--nodes", "3", "--capture-nodes", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["hours"]["capture_nodes"] == 1
    assert cli.main(["plan", str(STREAMED), "--nodes", "4", "--capture-nodes", "4"]) == 2
    assert "--capture-nodes 4 leaves none of the 4 node(s) to the trainers: give 1 to 3" in capsys.readouterr().err
    assert cli.main(["plan", str(KIMI), "--capture-nodes", "1"]) == 2
    assert "--capture-nodes plans training.features streamed" in capsys.readouterr().err


def test_an_online_plan_on_several_nodes_says_what_streaming_would_take(capsys):
    assert cli.main(["plan", str(KIMI), "--nodes", "4"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == ("training stays on 1 node of 4 (features online); streamed, 2 capturing and 2 training: first "
                       "run 12.12 h, retrain 4.55 h (--set training.features=streamed)")
    assert cli.main(["plan", str(KIMI)]) == 0
    assert "training stays on 1 node" not in capsys.readouterr().out


def test_a_kimi_k3_sized_target_captures_at_tp8_pp2_over_two_nodes():
    plan = plan_memory(load_config(K3))
    assert plan.all_fit and 1300 < plan.target.weight_bytes / 2**30 < 1500  # ~1.42 TB published on disk
    worker = next(stage for stage in plan.stages if stage.name == "capture worker")
    assert worker.gpus == 16 and worker.parts["target weights (/16)"] < 100
    one_node = plan_memory(load_config(K3, ["serving.pp=1"]))  # TP8 on one node does not hold it
    assert not one_node.all_fit and "capture worker" in " ".join(one_node.refusals())
    assert plan.retrain.scenario.capture_nodes == 2 and plan.retrain.total_h is not None
    two = streamed_hours(K3, 2)[False]  # one capture node holds no replica of 16 GPUs
    assert two["stages"][2]["unknown"].startswith("a replica of the target is 16 GPUs")
    config = load_config(K3)  # planned, not launched
    with pytest.raises(LaunchError, match="serving.pp 2: the launchers start a server at serving.tp 8"):
        serving_engine("sglang").check(launch_spec(config), config.production.telemetry, config.sweep)
