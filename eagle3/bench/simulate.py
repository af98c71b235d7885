"""Offline acceptance simulator: greedy speculative decoding (chains and trees) replayed over the target's
greedy output.

For a greedy target the accepted tokens are exactly its greedy continuation, so one target pass over
prompt + continuation gives every feature the draft needs, and a draft tree's accepted path is the one that
follows the continuation. The continuation runs num_steps tokens past max_new_tokens and past EOS, because a
verify step can accept drafts there, and SGLang counts them. The request grows, finishes and counts as the
served release does (`eagle3.bench.counting`):

    accept_length = Σ completion_tokens / Σ verify_ct
    accept_rate   = Σ correct_drafts / (Σ verify_ct × (num_draft_tokens - 1))

Sampled decoding (temperature > 0) is measured on a server only: its acceptance depends on the coins.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from eagle3.algorithms import DraftAlgorithm, draft_algorithm
from eagle3.algorithms.base import DraftModel
from eagle3.bench import counting
from eagle3.bench.client import suite_lines
from eagle3.bench.counting import SpecRequest
from eagle3.config import PipelineConfig
from eagle3.config.run import RunSection, TargetSection
from eagle3.config.serving import BenchmarkSection, ServingSection
from eagle3.config.suites import HELDOUT
from eagle3.data.capture import HELDOUT_DIR
from eagle3.data.continuations import suites_dir
from eagle3.data.prompts import BASE_SLICE
from eagle3.data.regenerate import GREEDY_FILE, greedy_length, read_greedy, regen_dir, simulated_shapes
from eagle3.data.shards import ShardReader, StoredSample
from eagle3.data.suite_capture import suite_features_dir
from eagle3.runtime.backends import local_device
from eagle3.runtime.generators import target_greedy
from eagle3.runtime.targets import target_eos_ids
from eagle3.errors import UnreadableInput
from eagle3.fsutil import atomic_write_json
from eagle3.model.aux_states import aux_states
from eagle3.model.tree import DraftTree, walk_greedy
from eagle3.progress import Progress
from eagle3.serving import serving_engine
from eagle3.serving.sglang import sglang_method
from eagle3.shape import DraftShape

Log = Callable[[str], None]


@dataclass(frozen=True)
class Replay:
    """What the simulator reads of a run's config (`replay_of`)."""

    run: RunSection  # the data stage's stored sequences
    target: TargetSection  # the draft shares its embedding; its end tokens end a request
    serving: ServingSection  # the release served: the draft's layout and the counting rules
    benchmark: BenchmarkSection  # the suites replayed and their max_new_tokens
    shapes: tuple[DraftShape, ...]  # simulated_shapes: serving's first
    length: int  # greedy_length: how far each stored sequence must continue


def replay_of(config: PipelineConfig) -> Replay:
    """The simulator's spec of a config with serving and benchmark sections."""
    return Replay(config.run, config.target, config.serving, config.benchmark,
                  tuple(simulated_shapes(config.replay_shape, config.sweep)), greedy_length(config))


@dataclass
class PromptResult:
    completion_tokens: int
    verify_ct: int
    correct_drafts: int
    histogram: list[int]  # verify steps by number of correct drafts, as long as the largest number seen
    suite: str = HELDOUT  # the benchmark suite the request belongs to, and its slice there
    slice: str = BASE_SLICE


@dataclass
class AcceptanceResult:
    shape: DraftShape
    rows: list[PromptResult]

    @property
    def completion_tokens(self) -> int:
        return sum(row.completion_tokens for row in self.rows)

    @property
    def verify_ct(self) -> int:
        return sum(row.verify_ct for row in self.rows)

    @property
    def correct_drafts(self) -> int:
        return sum(row.correct_drafts for row in self.rows)

    @property
    def histogram(self) -> list[int]:
        return counting.sum_histograms(row.histogram for row in self.rows)

    @property
    def accept_length(self) -> float | None:  # None like SGLang's absent keys: no verify step at all
        return counting.accept_length(self.completion_tokens, self.verify_ct)

    @property
    def accept_rate(self) -> float | None:
        return counting.accept_rate(self.correct_drafts, self.verify_ct, self.shape.drafts_per_step)

    def to_dict(self) -> dict:
        return {
            "num_prompts": len(self.rows),
            **asdict(self.shape),
            "completion_tokens": self.completion_tokens,
            "verify_ct": self.verify_ct,
            "correct_drafts": self.correct_drafts,
            "accept_length": self.accept_length,
            "accept_rate": self.accept_rate,
            "histogram": self.histogram,
            "suites": counting.by_suite([asdict(row) for row in self.rows], self.shape.drafts_per_step),
            "prompts": [asdict(row) for row in self.rows],
        }


def aux_features(model, seq: list[int], aux_layers: list[int]) -> torch.Tensor:
    """[T, n_aux * H] float32: the outputs of decoder layers `aux_layers`."""
    out = model(torch.tensor([seq]), output_hidden_states=True)
    return aux_states(out.hidden_states, aux_layers)[0].float()


def replay(seq: list[int], prompt_len: int, propose: Callable[[int], DraftTree], num_steps: int,
           max_new_tokens: int, eos_ids: frozenset[int], release: str | None,
           method: str | None = None) -> PromptResult:
    """Count drafting over a known greedy sequence as `release` counts `method` (SGLang's --speculative-algorithm;
    None: as EAGLE's); propose(P) drafts the tree after the verified x_P. The simulator's sequence runs num_steps
    tokens past where any request can finish; a shorter one (a stored reply, in the trainer's estimate) cuts the last
    runs where it ends."""
    request = SpecRequest(max_new_tokens, eos_ids, release, method)
    request.add_token(seq[prompt_len])  # the prefill's token: no verify step
    p = prompt_len  # index of the last verified token
    while request.finish is None:
        tree, most = propose(p), min(num_steps, len(seq) - p - 2)  # leave room for the bonus token
        accepted = len(walk_greedy(tree, lambda node: seq[p + 1 + tree.depth(node)], most))  # noqa: B023
        run = seq[p + 1 : p + 2 + accepted]  # accepted drafts + the bonus token
        request.add_verify(run)
        p += len(run)
    return PromptResult(len(request.output), request.verify_ct, request.correct, request.histogram)


@torch.no_grad()
def simulate_prompt(algorithm: DraftAlgorithm, draft: DraftModel, target_model, aux_layers: list[int],
                    prompt_ids: list[int], max_new_tokens: int, shape: DraftShape, eos_ids: frozenset[int],
                    release: str | None) -> PromptResult:
    seq = list(prompt_ids) + target_greedy(target_model, list(prompt_ids), max_new_tokens + shape.num_steps)
    aux = aux_features(target_model, seq, aux_layers)  # [T, n_aux * H]
    propose = proposer(algorithm, draft, aux, torch.tensor(seq), shape)
    return replay(seq, len(prompt_ids), propose, shape.num_steps, max_new_tokens, eos_ids, release,
                  sglang_method(algorithm))


def proposer(algorithm: DraftAlgorithm, draft: DraftModel, aux: torch.Tensor, tokens: torch.Tensor,
             shape: DraftShape) -> Callable[[int], DraftTree]:
    """Drafting over one known sequence (aux [T, n_aux * H] its features, tokens [T] its ids): P -> the drafts after
    x_P from the features and tokens before, as a server would draft them for the request growing along it."""
    drafter = algorithm.drafter(draft, shape)
    return lambda p: drafter(aux[:p], tokens[: p + 1])


def render_table(result: AcceptanceResult) -> list[str]:
    if result.verify_ct == 0:
        return [f"simulate: {len(result.rows)} prompts, no verify step (every continuation is one token)"]
    buckets = " ".join(f"{a}:{count}" for a, count in enumerate(result.histogram))
    return [
        f"simulate: {len(result.rows)} prompts, {result.completion_tokens} completion tokens, {result.verify_ct} verify steps",
        f"  accept length  {result.accept_length:.3f}  (completion tokens / verify steps)",
        f"  accept rate    {result.accept_rate:.3f}  (correct drafts / (verify steps x {result.shape.drafts_per_step}))",
        f"  histogram      {buckets}  (verify steps by correct drafts)",
    ]


@dataclass(frozen=True)
class HeldoutRef:
    """One stored benchmark greedy sequence, read when it is replayed (at Kimi's size a sequence's features are
    ~150 MB: a rank reads only its share), and the suite and slice of its request."""

    reader: ShardReader
    index: int
    suite: str = HELDOUT
    slice: str = BASE_SLICE

    def load(self) -> StoredSample:
        return self.reader.sample(self.index)


def replay_stored(algorithm: DraftAlgorithm, draft: DraftModel, sample: StoredSample, shape: DraftShape,
                  max_new_tokens: int, eos_ids: frozenset[int], release: str | None) -> PromptResult:
    """Replay one stored held-out greedy sequence (loss_mask marks the continuation) with its stored features,
    drafting as `algorithm` drafts."""
    mask = sample.loss_mask.bool()
    prompt_len = int(mask.long().argmax())
    seq = sample.input_ids.long()  # [T]
    device = next(draft.parameters()).device
    aux = sample.aux_hidden.to(device, torch.float32)  # [T, n_aux * H]
    propose = proposer(algorithm, draft, aux, seq.to(device), shape)
    return replay(seq.tolist(), prompt_len, propose, shape.num_steps, max_new_tokens, eos_ids, release,
                  sglang_method(algorithm))


def heldout_samples(run: RunSection, wanted: int, suites: tuple[str, ...] = (HELDOUT,)) -> list[HeldoutRef]:
    """The stored greedy sequences of the requests of `suites` with their features - the held-out suite's (the capture
    stage's data/heldout), the others' (the suite features stage's), read only when asked for - refused unless each
    continues `wanted` tokens (eagle3.data.regenerate.greedy_length: the benchmark's max_new_tokens and the deepest
    drafting shape)."""
    stored = stored_sequences(run.stage_dir("data") / HELDOUT_DIR, regen_dir(run))
    if any(suite != HELDOUT for suite in suites):
        stored += stored_sequences(suite_features_dir(run), suites_dir(run))
    refuse_unstored_suites(suites, {row["suite"] for _, _, row in stored}, suites_dir(run) / GREEDY_FILE)
    refs = [HeldoutRef(reader, i, row["suite"], row["slice"]) for reader, i, row in stored if row["suite"] in suites]
    short = [ref for ref in refs if int(ref.reader.sample(ref.index, ("input_ids", "loss_mask")).loss_mask.sum()) < wanted]
    if short:
        raise UnreadableInput(f"{len(short)} stored benchmark sequence(s) continue fewer than {wanted} tokens "
                              "(the replay's max_new_tokens + drafting steps: benchmark.max_new_tokens or "
                              "training.replay_max_new_tokens, + the deepest of serving.num_steps and sweep.points): "
                              "run the data stage again")
    return refs


def stored_sequences(features: Path, requests: Path) -> list[tuple[ShardReader, int, dict]]:
    """(its shard, its index there, its request) of every sequence stored in `features`, whose requests are the rows
    of `requests`' greedy continuations, in order."""
    if not features.is_dir():
        raise UnreadableInput(f"{features}: no stored sequences; run the data stage (eagle3 data capture)")
    readers = [ShardReader(path) for path in sorted(features.glob("shard-?????.safetensors"))]
    stored = [(reader, i) for reader in readers for i in range(len(reader))]
    rows = read_greedy(requests)
    if len(rows) != len(stored):
        raise UnreadableInput(f"{features}: {len(stored)} stored sequences for the {len(rows)} benchmark requests of "
                              f"{requests / GREEDY_FILE}: run the data stage again (eagle3 data capture)")
    return [(reader, i, row) for (reader, i), row in zip(stored, rows)]


def refuse_unstored_suites(suites: tuple[str, ...], stored: set[str], path: Path) -> None:
    """A suite asked for with no stored continuation is refused: replaying the others alone would report the run's
    figures without it, and the gate would judge a table that lacks a suite it was told to judge."""
    missing = [name for name in suites if name not in stored]
    if missing:
        raise UnreadableInput(
            f"benchmark.suites names {', '.join(missing)}, but {path} holds no continuation of "
            f"{'it' if len(missing) == 1 else 'them'} (only of {', '.join(sorted(stored)) or 'no suite'}): run `eagle3 "
            "data regenerate` with this benchmark.suites (it makes every suite's continuations), then `eagle3 data "
            "capture`")


def counting_release(serving: ServingSection | None) -> str | None:
    """The release whose finish and counting rules the serving engine's counts follow (None: the newest's)."""
    return serving_engine(serving.engine).counting_release(serving.release) if serving is not None else None


@torch.no_grad()
def simulate_shape(algorithm: DraftAlgorithm, draft: DraftModel, samples: list[HeldoutRef], shape: DraftShape,
                   benchmark: BenchmarkSection, serving: ServingSection, eos_ids: frozenset[int],
                   log: Log) -> AcceptanceResult:
    progress = Progress(f"simulate {shape.label()}", total=len(samples), unit="requests", log=log)
    rows = []
    for ref in samples:
        row = replay_stored(algorithm, draft, ref.load(), shape, benchmark.max_new_tokens, eos_ids,
                            counting_release(serving))
        rows.append(replace(row, suite=ref.suite, slice=ref.slice))
        progress.advance(1, tokens=row.completion_tokens)
    return AcceptanceResult(shape, rows)


@torch.no_grad()
def simulate_shapes(spec: Replay, checkpoint: Path, log: Log = print) -> list[AcceptanceResult]:
    """The served draft at `checkpoint` replayed over every suite's stored greedy sequences, in serving's shape and in
    each sweep point's (`simulated_shapes`, serving's first); no target is loaded."""
    entry = draft_algorithm(Path(checkpoint))
    draft = entry.served_model(Path(checkpoint), spec.serving.release, Path(spec.target.path),
                               spec.target.weight_prefix)
    draft = draft.to(local_device()).eval()
    samples = heldout_samples(spec.run, spec.length, tuple(suite.name for suite in spec.benchmark.suites))
    eos_ids = target_eos_ids(spec.target.path)
    return [simulate_shape(entry, draft, samples, shape, spec.benchmark, spec.serving, eos_ids, log)
            for shape in spec.shapes]


def simulate(spec: Replay, checkpoint: Path, out: Path, log: Log = print,
             fields: dict | None = None) -> AcceptanceResult:
    """Simulate the served draft at `checkpoint` (`simulate_shapes`), log and write the figures to `out`, with
    `fields` (what the draft is, when it is not the run's). Returns serving's shape's result."""
    results = simulate_shapes(spec, checkpoint, log)
    result = results[0]
    for line in render_table(result):
        log(line)
    for shaped in results:
        for line in suite_lines(shaped.to_dict()["suites"]):
            log(f"simulate {shaped.shape.label()}:{line}")
    shapes = [{"label": r.shape.label(), **{k: v for k, v in r.to_dict().items() if k != "prompts"}} for r in results]
    atomic_write_json(out, {"checkpoint": str(checkpoint), **(fields or {}), "engine_release": spec.serving.release,
                            "max_new_tokens": spec.benchmark.max_new_tokens, **result.to_dict(), "shapes": shapes})
    log(f"simulate: wrote {out}")
    return result
