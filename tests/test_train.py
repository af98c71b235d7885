"""The draft, its TTT alignment, and the trainer on the micro target: DDP equivalence, exact resume."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from eagle3.algorithms.eagle3 import EAGLE3
from eagle3.algorithms.init_copy import resolved_init
from eagle3.resolve import load_config
from eagle3.algorithms.eagle3.checkpoint import convert, load_native
from eagle3.draft.vocab_map import VocabMap, build_vocab_map
from eagle3.algorithms.eagle3 import model as draft_module
from eagle3.model import teacher as teacher_module
from eagle3.model.blocks import causal_mask
from eagle3.model.teacher import TeacherHead, chunked_argmax
from eagle3.model.blocks import LossRows, step_stats
from eagle3.algorithms.eagle3.ttt import draft_chain, target_positions, ttt_forward, ttt_loss
from eagle3.algorithms.eagle3.served import draft_as_served, draft_from_native
from eagle3.model.weights import target_head
from eagle3.distributed import Dist
from eagle3.errors import Eagle3Error
from eagle3.init_draft import resolve_init_from
from eagle3.train.trainer import Trainer
from helpers import TINY, metrics, run_copy, tiny_draft


class TestAlignment:
    """docs/contracts.md: step 0 at t reads f_t and x_{t+1} and predicts x_{t+2}; step k shifts by k."""

    def test_targets_and_masks_by_hand(self):
        x = torch.tensor([[10, 11, 12, 13, 14, 15]])
        mask = torch.tensor([[0, 0, 1, 1, 1, 1]])
        last = torch.zeros(1, 6, 16)
        for i in range(5):
            last[0, i, x[0, i + 1]] = 10.0  # row i predicts token i + 1 (through an identity head)
        rows = LossRows.of(mask, 2)
        teacher = TeacherHead(torch.eye(16), torch.arange(16))(last, rows.teacher)

        def one_hot(shift):  # draft logits whose argmax at index t is x[t + shift]
            logits = torch.zeros(1, 6, 16)
            for t in range(6 - shift):
                logits[0, t, x[0, t + shift]] = 10.0
            return logits

        right = step_stats([one_hot(2), one_hot(3)], teacher, rows)
        assert right.count.tolist() == [4, 3]  # step 0: t in 0..3 (x_2..x_5); step 1: t in 0..2 (x_3..x_5)
        assert target_positions(mask, 2).tolist() == [4, 3]  # the loss's normaliser, from the mask alone
        assert right.correct.tolist() == [4, 3]
        off_by_one = step_stats([one_hot(1), one_hot(2)], teacher, rows)
        assert off_by_one.correct.tolist() == [0, 0]

    def test_no_step_sees_the_future(self):
        model = tiny_draft()
        aux, ids = torch.randn(1, 10, 96), torch.randint(0, 16, (1, 10))
        base = ttt_forward(model, aux, ids, 3)
        t = 4
        for k in range(3):
            future_ids = ids.clone()
            future_ids[0, t + 2 + k :] = (future_ids[0, t + 2 + k :] + 1) % 16
            future_aux = aux.clone()
            future_aux[0, t + 1 :] += 1.0
            changed = ttt_forward(model, future_aux, future_ids, 3)
            assert torch.allclose(changed[k][0, t], base[k][0, t], atol=1e-5), k
            own_input = ids.clone()
            own_input[0, t + 1 + k] = (own_input[0, t + 1 + k] + 1) % 16
            assert not torch.allclose(ttt_forward(model, aux, own_input, 3)[k][0, t], base[k][0, t])
        own_features = aux.clone()
        own_features[0, t] += 1.0  # step 0 at t reads f_t itself (not f_{t-1})
        assert not torch.allclose(ttt_forward(model, own_features, ids, 1)[0][0, t], base[0][0, t])

    def test_training_computes_exactly_what_chain_drafting_serves(self):
        model = tiny_draft(seed=3)
        aux, ids = torch.randn(12, 96), torch.randint(0, 16, (12,))
        t = 6  # the chain rooted at t: prefix features 0..t, last verified token x_{t+1}
        drafts = draft_chain(model, aux[: t + 1], ids[: t + 2], steps=3)
        teacher = torch.cat([ids[: t + 2], torch.tensor(drafts[:2])])[None]  # feed the chain's own drafts
        steps = ttt_forward(model, aux[None, : teacher.shape[1]], teacher, 3)
        assert [int(s[0, t].argmax()) for s in steps] == drafts


def dense_ttt_attention(attention, q, keys, values):
    """The reference: every block scored under one [T, (k + 1) * T] mask (causal block, then diagonals)."""
    length = q.shape[2]
    mask = torch.cat([causal_mask(length)] + [torch.eye(length, dtype=torch.bool)] * (len(keys) - 1), dim=1)
    return attention.attend(q, torch.cat(keys, dim=2), torch.cat(values, dim=2), mask)


@pytest.mark.parametrize("blocks", [1, 2, 4])
@pytest.mark.parametrize("chunk", [4, 256])  # several query chunks (the last one short), and one
def test_ttt_attention_equals_the_dense_mask_with_its_gradients(blocks, chunk, monkeypatch):
    monkeypatch.setattr(draft_module, "TTT_QUERY_CHUNK", chunk)
    attention = tiny_draft().midlayer.self_attn.double()
    generator = torch.Generator().manual_seed(blocks)
    q = torch.randn(2, 4, 9, 8, dtype=torch.float64, generator=generator, requires_grad=True)  # 4 heads over 2 kv heads
    keys = [torch.randn(2, 2, 9, 8, dtype=torch.float64, generator=generator, requires_grad=True) for _ in range(blocks)]
    values = [torch.randn(2, 2, 9, 8, dtype=torch.float64, generator=generator, requires_grad=True) for _ in range(blocks)]
    compact = attention.attend_ttt(q, keys, values)
    dense = dense_ttt_attention(attention, q, keys, values)
    torch.testing.assert_close(compact, dense, rtol=0, atol=1e-12)
    leaves = [q, *keys, *values]
    for a, b in zip(torch.autograd.grad(compact.sum(), leaves), torch.autograd.grad(dense.sum(), leaves)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_chunked_argmax_equals_argmax_and_keeps_the_lowest_id_on_ties():
    generator = torch.Generator().manual_seed(0)
    x, weight = torch.randn(3, 5, 16, generator=generator), torch.randn(37, 16, generator=generator)
    weight[30] = weight[4]  # a tie across chunks: the lower id wins, as in torch.argmax
    x[0, 0] = weight[4] * 10
    for rows in (1, 5, 8, 37, 64):
        assert torch.equal(chunked_argmax(x, weight, rows), (x @ weight.T).argmax(-1))
    assert chunked_argmax(x, weight, 8)[0, 0] == 4


def test_a_bf16_teacher_head_takes_float32_hidden_states():
    """On a GPU the trainer keeps the target's head in bf16 while the batch arrives in float32."""
    head = TeacherHead(torch.randn(40, 32).bfloat16(), torch.arange(0, 40, 3), torch.ones(32), 1e-6)
    teacher = head(torch.randn(2, 5, 32))
    assert teacher.argmax.shape == (2, 5) and teacher.probs.dtype == torch.float32
    torch.testing.assert_close(teacher.probs.sum(-1), torch.ones(2, 5))


def test_compact_teacher_gives_the_loss_of_full_vocabulary_logits():
    """The compact teacher against the full [B, T, V] logits it replaces: argmax over V, softmax over the draft rows."""
    model = tiny_draft(vocab=40, draft_vocab=16)
    hot = torch.tensor(sorted(torch.randperm(40, generator=torch.Generator().manual_seed(1))[:16].tolist()))
    with torch.no_grad():
        model.d2t.copy_(hot - torch.arange(16))
    generator = torch.Generator().manual_seed(2)
    last, lm_head = torch.randn(2, 12, 32, generator=generator), torch.randn(40, 32, generator=generator)
    loss_mask, ids = torch.ones(2, 12, dtype=torch.long), torch.randint(0, 40, (2, 12), generator=generator)
    step_logits = ttt_forward(model, torch.randn(2, 12, 96, generator=generator), ids, 3)
    rows = LossRows.of(loss_mask, 3)
    compact = step_stats(step_logits, TeacherHead(lm_head, hot)(last, rows.teacher), rows)
    full = last @ lm_head.T  # [B, T, V]
    argmax, probs = full.argmax(-1), full[..., hot].softmax(-1)
    in_draft = torch.zeros(40, dtype=torch.bool)
    in_draft[hot] = True
    for k, logits in enumerate(step_logits):
        valid = torch.zeros(2, 12, dtype=torch.bool)
        valid[:, : 12 - 2 - k] = in_draft[argmax[:, 1 + k : 11]]  # row t+1+k teaches step k at t
        loss = (-(probs[:, 1 + k : 12 - 1] * logits[:, : 12 - 2 - k].log_softmax(-1)).sum(-1) * valid[:, : 12 - 2 - k]).sum()
        torch.testing.assert_close(compact.loss_sum[k], loss, rtol=1e-6, atol=1e-5)
        assert compact.count[k] == valid.sum()
        correct = (hot[logits.argmax(-1)] == torch.nn.functional.pad(argmax[:, 1 + k :], (0, 1 + k))) & valid
        assert compact.correct[k] == correct.sum()


def test_the_teacher_and_the_head_score_only_the_rows_the_loss_reads():
    """Rows whose next token is not generated (prompt, padding) are never scored: the same loss, counts and accuracy
    as scoring every position, from a teacher that scored only the loss's rows."""
    model = tiny_draft(vocab=40, draft_vocab=16)
    generator = torch.Generator().manual_seed(4)
    head = TeacherHead(torch.randn(40, 32, generator=generator), model.hot_token_ids())
    last, aux = torch.randn(2, 12, 32, generator=generator), torch.randn(2, 12, 96, generator=generator)
    ids = torch.randint(0, 40, (2, 12), generator=generator)
    loss_mask = torch.tensor([[0] * 5 + [1] * 7, [0] * 3 + [1] * 6 + [0] * 3])  # a prompt, a reply, padding
    rows = LossRows.of(loss_mask, 3)
    assert [int(here.sum()) for here in rows.present] == target_positions(loss_mask, 3).tolist()
    dense, part = head(last), head(last, rows.teacher)
    scored = torch.zeros(24, dtype=torch.bool).index_fill_(0, rows.teacher, True).view(2, 12)
    assert scored.sum() == 13 and not scored[1, 9:].any()  # 7 + 6 generated tokens: the rows before them
    torch.testing.assert_close(part.probs, dense.probs[scored])
    assert torch.equal(part.argmax, dense.argmax[scored]) and torch.equal(part.in_draft, dense.in_draft[scored])
    every = step_stats(ttt_forward(model, aux, ids, 3), part, rows)  # all logits, gathered at the rows
    lean = ttt_loss(model, aux, ids, part, rows)  # the head run on the rows only
    torch.testing.assert_close(lean.loss_sum, every.loss_sum)
    assert torch.equal(lean.count, every.count) and torch.equal(lean.correct, every.correct)


@pytest.fixture(scope="module")
def trained(micro_data, tmp_path_factory):
    overrides, run_dir = run_copy(micro_data, tmp_path_factory.mktemp("trained"), "run", ["training.max_steps=40"])
    Trainer(load_config(TINY, overrides), log=lambda line: None).run()
    return overrides, run_dir


def test_loss_falls_and_accuracy_rises(trained):
    _, run_dir = trained
    lines = [m for m in metrics(run_dir) if "loss" in m]
    first, last = lines[0], lines[-1]
    assert last["loss"] < 0.8 * first["loss"]
    assert last["step_acc"][0] > first["step_acc"][0] + 0.2
    evals = [m for m in metrics(run_dir) if "eval_loss" in m]
    assert len(evals) == 4 and evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    # Simulated accept length on held-out samples: well above the never-accepted baseline n/(n-1).
    assert evals[-1]["eval_accept_length"] > 1.5 and evals[-1]["eval_accept_length"] > evals[0]["eval_accept_length"]
    assert (run_dir / "train" / "best" / "model.safetensors").exists()
    assert len(list((run_dir / "train" / "checkpoints").glob("step-*"))) == 2  # keep_last


def test_export_to_sglang_and_back_gives_identical_logits(trained, micro_target):
    _, run_dir = trained
    final = run_dir / "train" / "final"
    convert(final, run_dir / "export-sglang", to="sglang", release="0.5.13")
    embed = target_head(micro_target)["embed"]
    trained_model = draft_from_native(load_native(final), embed)
    served = draft_as_served(run_dir / "export-sglang", "0.5.13", embed)
    aux, ids = torch.randn(1, 20, 3 * 64), torch.randint(0, 512, (1, 20))
    for a, b in zip(ttt_forward(trained_model, aux, ids, 3), ttt_forward(served, aux, ids, 3)):
        assert torch.equal(a, b)


def test_a_warm_start_under_another_vocab_map_carries_the_head_rows_by_target_id(trained, micro_data, micro_target,
                                                                                 tmp_path):
    """A retrain on new traffic counts other tokens: the head's rows follow their target ids, new ids start from the
    target's head, and every other tensor is the previous draft's."""
    _, run_dir = trained
    final = run_dir / "train" / "final"
    same_vocab, _ = run_copy(micro_data, tmp_path, "warm", [f"training.init_from={final}", "training.max_steps=2"])
    warm = load_config(TINY, same_vocab)
    resolve_init_from(warm.run, warm.training, warm.draft, warm.target,
                      warm.serving, warm.registry, log=lambda line: None)
    Trainer(warm, log=lambda line: None).run()  # accepted
    other = load_native(final)
    old_ids = VocabMap(other.tensors["d2t"], other.tensors["t2d"]).target_ids()
    other_map, _ = build_vocab_map(torch.arange(512, 0, -1), other.tensors["d2t"].numel())  # the lowest 128 ids
    remapped, _ = run_copy(micro_data, tmp_path, "remapped", [f"training.init_from={final}"])
    config = load_config(TINY, remapped)
    resolve_init_from(config.run, config.training, config.draft, config.target,
                      config.serving, config.registry, log=lambda line: None)
    lines = []
    target = target_head(micro_target)
    head = target["lm_head"]
    init = resolved_init(config.run, config.training)
    cfg = EAGLE3.draft_config(config.draft, config.target, config.vocab.draft_vocab_size, config.data.aux_layers)
    model = EAGLE3.initial_model(cfg, config.training, target, other_map, torch.device("cpu"), init, lines.append)
    new_ids = other_map.target_ids()
    shared = [(j, int((old_ids == t).nonzero())) for j, t in enumerate(new_ids.tolist()) if t in old_ids]
    assert 0 < len(shared) < len(new_ids)
    for j, i in shared:
        assert torch.equal(model.lm_head.weight[j], other.tensors["lm_head.weight"][i])
    fresh = [j for j, t in enumerate(new_ids.tolist()) if t not in old_ids]
    assert torch.equal(model.lm_head.weight[fresh], head[new_ids[fresh]])
    assert torch.equal(model.d2t, other_map.d2t) and torch.equal(model.fc.weight, other.tensors["fc.weight"])
    assert any(f"{len(shared)} of 128 head rows carried over by target id" in line for line in lines), lines


def test_micro_batches_make_the_update_of_one_batch(micro_data, tmp_path):
    """4 micro-batches of 2 accumulate the gradients of one batch of 8, the loss divided by the global batch's
    loss-masked target positions per step; after the optimizer step the drafts are the same."""
    trainers = {}
    for micro in (None, 2):
        overrides, _ = run_copy(micro_data, tmp_path, f"micro-{micro}", [f"training.micro_batch_size={micro or 'null'}"])
        trainers[micro] = Trainer(load_config(TINY, overrides), log=lambda line: None)
    whole, split = trainers[None], trainers[2]
    refs = whole.data.train[:8]
    assert split.per_forward == 2 and whole.per_forward == 8
    # the objective by hand, on the whole batch at once
    stats = whole.step_stats(refs, train=True)
    positions = target_positions(whole.data.tokens(refs)[1], whole.config.training.ttt_steps)
    assert torch.all(stats.count <= positions) and torch.all(stats.count > 0)
    (whole.step_weights * stats.loss_sum / positions).sum().backward()
    by_hand = grads(whole)
    whole.optimizer.zero_grad(set_to_none=True)
    sums = {micro: trainer.accumulate_gradients(refs) for micro, trainer in trainers.items()}
    torch.testing.assert_close(sums[2], sums[None])
    torch.testing.assert_close(sums[None][0], stats.loss_sum.detach())
    assert sums[None][3].tolist() == stats.count.tolist()  # the metrics' valid positions, summed over micro-batches
    for trainer in trainers.values():
        torch.testing.assert_close(grads(trainer), by_hand)
    before = whole.model.fc.weight.detach().clone()
    for trainer in trainers.values():
        trainer.optimizer.step()
    # AdamW's first step moves each weight by ~lr x sign(gradient): where a gradient is ~0, the last bits of another
    # summation order move it by another fraction of lr (seen: 3.4e-5 at lr 3e-3), so the drafts agree to lr / 20
    lr = whole.config.training.learning_rate
    torch.testing.assert_close(dict(split.model.named_parameters()), dict(whole.model.named_parameters()),
                               atol=lr / 20, rtol=0)
    assert not torch.equal(whole.model.fc.weight, before)  # the step moved the draft


def test_stored_features_take_the_full_vocabulary_argmax_once_per_position(micro_data, tmp_path, monkeypatch):
    """Over stored features a position's teacher argmax is computed in its first batch and remembered: the same
    samples in another batch (another width) take none and give the stats of a teacher that computes it; a batch with
    a sample never scored computes it again."""
    overrides, _ = run_copy(micro_data, tmp_path, "memo", [])
    trainer = Trainer(load_config(TINY, overrides), log=lambda line: None)
    computed, argmax = [], teacher_module.chunked_argmax
    monkeypatch.setattr(teacher_module, "chunked_argmax", lambda x, *rest: computed.append(len(x)) or argmax(x, *rest))
    refs = sorted(trainer.data.train, key=lambda ref: ref.length)
    trainer.step_stats(refs[-3:], train=False)
    assert len(computed) == 1 and trainer.teacher.memo.known.keys() == {ref.id for ref in refs[-3:]}
    again = trainer.step_stats([refs[-3], refs[-2]], train=False)  # narrower than the first batch
    assert len(computed) == 1
    memo, trainer.teacher.memo = trainer.teacher.memo, None
    fresh = trainer.step_stats([refs[-3], refs[-2]], train=False)
    assert len(computed) == 2
    for name in ("loss_sum", "correct", "count"):
        torch.testing.assert_close(getattr(again, name), getattr(fresh, name))
    trainer.teacher.memo = memo
    trainer.step_stats([refs[0], refs[-1]], train=False)  # refs[0] was never scored
    assert len(computed) == 3 and refs[0].id in memo.known


def grads(trainer):
    return {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.requires_grad}


def test_a_batch_that_does_not_split_over_the_running_ranks_is_refused(micro_data, tmp_path):
    """The config checks its own nproc_per_node; torchrun started by hand may run another number of ranks."""
    overrides, _ = run_copy(micro_data, tmp_path, "three", ["training.micro_batch_size=2"])
    with pytest.raises(Eagle3Error, match=r"training.batch_size 8 must be a multiple of the 3 ranks \(processes "
                       r"running\) x training.micro_batch_size 2 = 6: set it to 6 or lower training.micro_batch_size"):
        Trainer(load_config(TINY, overrides), log=lambda line: None, dist=Dist(world=3))


def rank_errors(stderr: str) -> str:
    """The workers' own error lines, not torchrun's wrapper traceback."""
    return "\n".join(line for line in stderr.splitlines() if line.startswith("[rank") and "Loading" not in line)[-4000:]


def train_command(overrides, nproc=None):
    entry = ["-m", "eagle3.train", "--config", str(TINY), *[f"--set={o}" for o in overrides]]
    if nproc is None:
        return [sys.executable, *entry]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *entry]


def test_two_online_ranks_in_micro_batches_equal_one_offline_rank_on_the_same_global_batch(micro_data, tmp_path):
    """Two gloo ranks computing the target's features online, a micro-batch at a time (2 per step, DDP syncing the
    last), against one rank taking the batch at once from bf16 shards: the same global batches give the same loss up
    to bf16's rounding of the stored features (~2e-5 measured)."""
    # eval every 3 steps in global batches of 2 (one forward's rows): ranks get uneven eval slices, which must
    # neither hang nor change the numbers
    steps = ["training.max_steps=6", "training.save_every=100", "training.eval_every=3", "training.batch_size=4"]
    single, single_dir = run_copy(micro_data, tmp_path, "single", steps)
    double, double_dir = run_copy(micro_data, tmp_path, "double", [*steps, "training.features=online",
                                                                   "training.micro_batch_size=1"])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for command in (train_command(single), train_command(double, nproc=2)):
        result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
        assert result.returncode == 0, rank_errors(result.stderr) or result.stderr[-3000:]
    one = [m for m in metrics(single_dir) if "loss" in m]
    two = [m for m in metrics(double_dir) if "loss" in m]
    assert len(one) == len(two) == 6
    for a, b in zip(one, two):
        assert a["loss"] == pytest.approx(b["loss"], rel=2e-3), a["step"]
        assert a["step_acc"] == pytest.approx(b["step_acc"], abs=0.02)  # a position or two may flip at this size
    evals = [[m for m in metrics(d) if "eval_loss" in m] for d in (single_dir, double_dir)]
    assert len(evals[0]) == len(evals[1]) == 2
    for a, b in zip(*evals):
        assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=2e-3)
        assert a["eval_accept_length"] == pytest.approx(b["eval_accept_length"], rel=0.05)


def test_resume_after_sigterm_reproduces_the_uninterrupted_curve(micro_data, tmp_path):
    steps = ["training.max_steps=16", "training.eval_every=100"]
    whole, whole_dir = run_copy(micro_data, tmp_path, "whole", steps)
    Trainer(load_config(TINY, whole), log=lambda line: None).run()
    split, split_dir = run_copy(micro_data, tmp_path, "split", steps)
    process = subprocess.Popen(train_command(split), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list((split_dir / "train" / "checkpoints").glob("step-0000004")) and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 143, err[-2000:]  # stopped cleanly, checkpoint saved, not finished
    assert "stopped by SIGTERM" in out
    stopped_at = len([m for m in metrics(split_dir) if "loss" in m])
    Trainer(load_config(TINY, split), log=lambda line: None).run()
    a = [m for m in metrics(whole_dir) if "loss" in m]
    b = [m for m in metrics(split_dir) if "loss" in m]
    assert stopped_at < 16 and [m["step"] for m in b] == list(range(1, 17))
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-6, abs=1e-6), x["step"]


def test_fsdp_on_two_ranks_in_micro_batches_equals_one_rank_and_resumes(micro_data, tmp_path):
    """FSDP2 accumulating 2 micro-batches of 2 per rank (gradient sync off for the first) against one rank taking the
    batch of 8 at once."""
    base = ["training.save_every=3", "training.eval_every=100"]
    single, single_dir = run_copy(micro_data, tmp_path, "single", [*base, "training.max_steps=6"])
    first_half, sharded_dir = run_copy(micro_data, tmp_path, "fsdp", [*base, "training.fsdp=true", "training.max_steps=3",
                                                                      "training.micro_batch_size=2"])
    # Stop at 3, then resume to 6 (the 5 warmup steps make the schedule the same for both lengths).
    second_half = [*first_half, "training.max_steps=6"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for command in (train_command(single), train_command(first_half, nproc=2), train_command(second_half, nproc=2)):
        result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
        assert result.returncode == 0, rank_errors(result.stderr) or result.stderr[-3000:]
    one = [m for m in metrics(single_dir) if "loss" in m]
    two = [m for m in metrics(sharded_dir) if "loss" in m]
    assert [m["step"] for m in two] == list(range(1, 7))
    for a, b in zip(one, two):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), a["step"]
    final = load_native(sharded_dir / "train" / "final")
    reference = load_native(single_dir / "train" / "final")
    for name, tensor in reference.tensors.items():
        torch.testing.assert_close(final.tensors[name], tensor, atol=1e-4, rtol=1e-3)


def test_absolute_d2t_simulates_at_baseline(trained, micro_target, tmp_path):
    from safetensors.torch import load_file, save_file

    from eagle3.bench.simulate import replay_of, simulate

    overrides, run_dir = trained
    config = load_config(TINY, [*overrides, "benchmark.num_prompts=6", "benchmark.max_new_tokens=24"])
    good = convert(run_dir / "train" / "final", tmp_path / "good", to="sglang", release="0.5.13")
    served = simulate(replay_of(config), good, tmp_path / "good.json", log=lambda line: None)
    broken = convert(run_dir / "train" / "final", tmp_path / "absolute", to="sglang", release="0.5.13")
    tensors = load_file(broken / "model.safetensors")
    tensors["d2t"] = tensors["d2t"] + torch.arange(tensors["d2t"].numel())  # absolute ids: the classic mistake
    save_file(tensors, broken / "model.safetensors")
    baseline = simulate(replay_of(config), broken, tmp_path / "absolute.json", log=lambda line: None)
    n = served.completion_tokens / len(served.rows)
    assert served.accept_length > 1.3
    assert baseline.accept_length < 1.1 * n / (n - 1)  # ~ never accepted


def test_eagle31_norms_train_export_and_load_as_trained(micro_data, tmp_path, micro_target):
    """fc_norm, norm_before_fc and norm_output: trained, exported for a release that serves all three, and read back as
    SGLang loads them with identical logits; a release that would skip one refuses the config and the export."""
    norms = ["draft.fc_norm=true", "draft.norm_before_fc=true", "draft.norm_output=true"]
    overrides, run_dir = run_copy(micro_data, tmp_path, "norms", [*norms, "serving.release=0.5.17",
                                                                  "training.max_steps=20", "training.eval_every=20"])
    Trainer(load_config(TINY, overrides), log=lambda line: None).run()
    lines = [m for m in metrics(run_dir) if "loss" in m]
    assert lines[-1]["loss"] < 0.8 * lines[0]["loss"]
    final = run_dir / "train" / "final"
    assert {"fc_norm.0.weight", "input_norm.weight"} <= set(load_native(final).tensors)
    convert(final, run_dir / "export-sglang", to="sglang", release="0.5.17")
    embed = target_head(micro_target)["embed"]
    trained_model, served = draft_from_native(load_native(final), embed), draft_as_served(run_dir / "export-sglang",
                                                                                          "0.5.17", embed)
    assert served.config.flags() == ["fc_norm", "norm_output", "norm_before_fc"]
    aux, ids = torch.randn(1, 20, 3 * 64), torch.randint(0, 512, (1, 20))
    for a, b in zip(ttt_forward(trained_model, aux, ids, 3), ttt_forward(served, aux, ids, 3)):
        assert torch.equal(a, b)
    with pytest.raises(Eagle3Error, match="norm_before_fc"):
        convert(final, tmp_path / "old", to="sglang", release="0.5.13")
    with pytest.raises(Eagle3Error, match=r"norm_before_fc, which SGLang 0\.5\.13 does not implement \(served from 0\.5\.17\)"):
        load_config(TINY, [*overrides, "serving.release=0.5.13"])


def test_norm_output_carries_the_normed_state_and_the_head_reads_it_once():
    model = tiny_draft()
    plain = tiny_draft()
    model.config = model.config.model_copy(update={"norm_output": True})
    hidden, attended = torch.randn(1, 5, 32), torch.randn(1, 5, 32)
    carried, logits = model.finish(hidden, attended)
    h, plain_logits = plain.finish(hidden, attended)
    torch.testing.assert_close(carried, plain.norm(h))
    torch.testing.assert_close(logits, plain_logits)  # the same head input either way
