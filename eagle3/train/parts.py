"""What a Trainer runs, built apart from running it: the data, the target's features, the held-out sequences its
evaluation replays, the draft algorithm's model and the teacher. Each part is its own function, so a test of one part
builds that part alone."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from eagle3.algorithms import DraftAlgorithm, algorithm
from eagle3.algorithms.base import DraftModel
from eagle3.algorithms.init_copy import ResolvedInit, resolved_init
from eagle3.bench.simulate import HeldoutRef, heldout_samples
from eagle3.config.data import DataSection, VocabSection
from eagle3.config.draft import DraftSection
from eagle3.config.run import RunSection, TargetSection
from eagle3.config.training import TrainingSection
from eagle3.data.capture import capture_settings, check_dataset, dataset_dir
from eagle3.data.regenerate import read_regenerated, regen_dir
from eagle3.data.vocab import count_loss_tokens
from eagle3.distributed import Dist
from eagle3.draft.vocab_map import VocabMap, load_vocab_map
from eagle3.runtime.backends import target_backend
from eagle3.runtime.features import FeatureBackend
from eagle3.runtime.targets import target_eos_ids
from eagle3.errors import Eagle3Error, UnreadableInput
from eagle3.model.weights import target_head
from eagle3.records.manifest import MANIFEST_FILE, read_manifest
from eagle3.stream.features import StreamedFeatures
from eagle3.stream.store import feature_settings
from eagle3.target.info import read_target_info
from eagle3.train.argmax_memo import RememberingTeacher
from eagle3.train.data import ShardFeatures, TrainingData

Log = Callable[[str], None]


@dataclass
class TrainingParts:
    algorithm: DraftAlgorithm  # draft.algorithm's entry
    data: TrainingData
    features: FeatureBackend
    heldout: list[HeldoutRef] | None  # None: training.best_by does not replay
    eos_ids: frozenset[int]
    init: ResolvedInit | None  # training.init_from, resolved before training
    model: DraftModel
    teacher: RememberingTeacher


def training_parts(run: RunSection, data_section: DataSection, target: TargetSection, training: TrainingSection,
                   draft: DraftSection, vocab: VocabSection, greedy: int, dist: Dist, log: Log) -> TrainingParts:
    """Every part of a run's training on this rank; `greedy`: the held-out continuations' length (greedy_length)."""
    entry = algorithm(draft.algorithm)
    manifest = dataset_manifest(run, data_section, target, training)
    data = training_data(run, training, log)
    features = feature_backend(data_section, target, training, data, manifest, dist, log)
    heldout = replayed_samples(run, training, greedy, data, log)
    head = target_head(Path(target.path), target.weight_prefix)  # float32, CPU
    vocab_map = read_vocab_map(run, vocab, target)
    init = resolved_init(run, training)
    cfg = entry.draft_config(draft, target, vocab.draft_vocab_size, data_section.aux_layers)
    refuse_generated(entry.reserved_ids(cfg), run, target)
    model = entry.initial_model(cfg, training, head, vocab_map, dist.device, init, log)
    model.set_recompute(recomputes(training.recompute, dist.device))
    teacher = build_teacher(data_section, target, training, head, vocab_map, dist.device,
                            remember=features.name == ShardFeatures.name)
    return TrainingParts(entry, data, features, heldout, target_eos_ids(target.path), init, model, teacher)


def dataset_manifest(run: RunSection, data: DataSection, target: TargetSection, training: TrainingSection) -> dict:
    """The capture stage's manifest, checked against the config's sections."""
    dataset = dataset_dir(run, training)
    if not (dataset / MANIFEST_FILE).exists():
        raise Eagle3Error(f"{dataset}: no data set here; run `eagle3 data capture` first")
    manifest = read_manifest(dataset)
    check_dataset(run, data, target, training, manifest)
    return manifest


def training_data(run: RunSection, train: TrainingSection, log: Log) -> TrainingData:
    data = TrainingData(dataset_dir(run, train), train.seq_len, train.eval_fraction)
    if data.without_loss:
        log(f"train: {data.without_loss} sample(s) left out: {data.left_out_why}")
    return data


def feature_backend(data_section: DataSection, target: TargetSection, training: TrainingSection, data: TrainingData,
                    manifest: dict, dist: Dist, log: Log) -> FeatureBackend:
    """Online: the target on this rank (tensor-parallel over the ranks with SGLang); streamed: the capture workers'
    store; offline: the stored shards."""
    if training.features == "online":
        return target_backend(data_section, target, dist.device, dist.rank, dist.world)
    if training.features == "streamed":
        settings = feature_settings(capture_settings(data_section, target))
        return StreamedFeatures(training.stream, lambda refs: data.tokens(refs)[0], settings, len(data_section.aux_layers) * target.hidden_size,
                                target.hidden_size, dist.device, log)
    return ShardFeatures(data, manifest["capture"]["engine_release"], dist.device)


def replayed_samples(run: RunSection, train: TrainingSection, greedy: int, data: TrainingData,
                     log: Log) -> list[HeldoutRef] | None:
    """The held-out greedy sequences evaluation replays (their continuations `greedy` tokens long: greedy_length), or
    None when training.best_by does not use them."""
    if train.best_by != "accept_length":
        log(f"train: evaluation skips the acceptance replay (training.best_by {train.best_by} does not use it)")
        if not data.eval:
            raise Eagle3Error(f"training.best_by {train.best_by} is measured on the eval split, which holds none of "
                              f"the {len(data.train)} samples: raise training.eval_fraction")
        return None
    try:
        return heldout_samples(run, greedy)[: train.replay_prompts]
    except UnreadableInput as err:
        raise Eagle3Error(f"training.best_by accept_length replays the held-out greedy sequences: {err}; or pick "
                          "the best draft by step_acc or eval_loss") from None


def read_vocab_map(run: RunSection, vocab: VocabSection, target: TargetSection) -> VocabMap:
    directory = run.stage_dir("vocab")
    vocab_map = load_vocab_map(directory)
    sizes = (vocab.draft_vocab_size, target.vocab_size)
    if (vocab_map.draft_vocab_size, vocab_map.target_vocab_size) != sizes:
        raise Eagle3Error(f"the vocab map in {directory} is {vocab_map.draft_vocab_size} of "
                          f"{vocab_map.target_vocab_size} ids; the config asks for {sizes[0]} of {sizes[1]}: "
                          "run `eagle3 vocab build` again")
    return vocab_map


def build_teacher(data: DataSection, target: TargetSection, training: TrainingSection, head: dict[str, torch.Tensor],
                  vocab_map: VocabMap, device: torch.device, remember: bool) -> RememberingTeacher:
    """The target's head on the device, bf16 on a GPU (its matmuls run in bf16 there anyway); `remember`: over stored
    features, each position's full-vocabulary argmax is computed once."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    norm = head["norm"].to(device) if data.last_hidden == "pre_norm" else None
    eps = read_target_info(Path(target.path)).rms_norm_eps
    return RememberingTeacher(head["lm_head"].to(device, dtype), vocab_map.target_ids().to(device), norm, eps,
                              training.teacher_temperature, remember=remember)


def refuse_generated(reserved: dict[int, str], run: RunSection, target: TargetSection) -> None:
    """Ids the draft gives a meaning of its own (`reserved`: each with the config field that names it) must never be
    generated by the target: one that is would stand for itself and for the draft's meaning at once. Counted over the
    regenerated replies."""
    if not reserved:
        return
    counts = count_loss_tokens(read_regenerated(regen_dir(run)), target.vocab_size)
    seen = {token: int(counts[token]) for token in reserved if counts[token]}
    if seen:
        token, times = next(iter(seen.items()))
        raise Eagle3Error(f"target id {token} occurs {times} time(s) in the target's regenerated replies "
                          f"({regen_dir(run)}), but the draft reserves it ({reserved[token]}): set an id the target "
                          "never generates")


def recomputes(setting: str, device: torch.device) -> bool:
    """training.recompute. `auto` reaches a trainer decided (the plan writes its choice into the run's resolved config,
    eagle3.plan.chosen_recompute) except when the trainer is built directly: then it recomputes on a GPU, whose memory
    the plan was not asked about, and not on the CPU, whose memory it does not save."""
    if setting == "auto":
        return device.type != "cpu"
    return setting == "norms_mlp"
