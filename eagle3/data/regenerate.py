"""Answer regeneration: the target writes every assistant turn, so the draft learns how the target
really speaks.

Engines (eagle3/runtime/generators.py): `local` (transformers) or `sglang` (running servers over HTTP); the
server's `output_ids` are stored as they are.

Output: JSONL shards under `run.dir/data/regen/`, one line per sample with the conversation,
`input_ids` and `loss_mask`. A sample already written is skipped on a re-run, so a crash loses at
most the batch in flight.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from eagle3.config import PipelineConfig
from eagle3.resolve import draft_configs
from eagle3.config.data import DataSection
from eagle3.config.run import RunSection, TargetSection
from eagle3.config.serving import BenchmarkSection, SweepSection
from eagle3.config.suites import HELDOUT
from eagle3.data.conversation import SampleBuilder, TemplateMismatch, chat_template_hash, encode
from eagle3.data.conversation import prompt_ids as render_prompt_ids
from eagle3.data.prompts import Prompt, PromptSet, load_prompts, split_heldout, write_prompts
from eagle3.data.quality import Reply, describe_figures, refuse_failed, report
from eagle3.data.storage import log_projection
from eagle3.data.suites import Question, continue_questions, heldout_prompts_file, suite_questions
from eagle3.data.traffic import describe_traffic, mixed, prompt_sources, traffic_prompts
from eagle3.runtime.generators import make_generator
from eagle3.runtime.targets import load_tokenizer, target_eos_ids, target_identity
from eagle3.errors import UnreadableInput
from eagle3.records.manifest import code_version, write_manifest
from eagle3.fsutil import atomic_write_bytes, atomic_write_json, sha256_file
from eagle3.progress import Progress
from eagle3.shape import DraftShape

Log = Callable[[str], None]
REGEN_DIR = "regen"
IDS_FILE = "sample_ids.json"
HELDOUT_FILE = "heldout.jsonl"
GREEDY_FILE = "heldout_greedy.jsonl"  # the target's greedy continuations of benchmark requests: the held-out suite's
# (here), the other suites' (in the suites stage's output, eagle3.data.continuations)
MALFORMED_FILE = "malformed.json"


def regen_dir(run: RunSection) -> Path:
    """The regenerate stage's output: the samples, their manifest and the held-out prompts' continuations (what
    training reads; the other suites' continuations are the suites stage's, eagle3.data.continuations)."""
    return run.stage_dir("data") / REGEN_DIR


# ---------------------------------------------------------------------------------------------
# Shards


def shard_path(directory: Path, index: int) -> Path:
    return directory / f"samples-{index:05d}.jsonl"


def read_done(directory: Path) -> set[str]:
    """Ids of samples already written. A line cut short by a crash is cut off so appends stay valid."""
    done = set()
    for path in sorted(directory.glob("samples-*.jsonl")):
        data = path.read_bytes()
        complete = data[: data.rfind(b"\n") + 1]
        if len(complete) != len(data):
            os.truncate(path, len(complete))
        done.update(json.loads(line)["id"] for line in complete.splitlines() if line.strip())
    return done


def read_regenerated(directory: Path):
    """Yield the samples of the current training split (ids in sample_ids.json); records left by an
    earlier run with another split or size are ignored."""
    current = set(training_ids(directory))
    return (record for record in read_samples(directory) if record["id"] in current)


def training_ids(directory: Path) -> list[str]:
    """The training split's sample ids, in split order (data.num_samples takes a prefix of it)."""
    try:
        return json.loads((Path(directory) / IDS_FILE).read_text())
    except FileNotFoundError:
        raise UnreadableInput(f"{directory}: no finished regeneration here; run `eagle3 data regenerate` first") from None


def read_samples(directory: Path):
    """Yield every sample record written in a regeneration directory, shard by shard."""
    for path in sorted(Path(directory).glob("samples-*.jsonl")):
        with open(path) as f:
            for line in f:
                yield json.loads(line)


# ---------------------------------------------------------------------------------------------
# The stage


def regenerate(config: PipelineConfig, log: Log = print, generator=None, store=None) -> Path:
    """Regenerate the training split's answers; returns the output directory (with its manifest). `store`: the
    registry's sample store for this run's context (eagle3.registry.samples), whose replies are taken and which
    keeps the new ones."""
    out = regen_dir(config.run)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(config.target)
    prompt_set, train, heldout = split_prompts(config.run, config.data, config.target,
                                               config.production.telemetry.slice_label, tokenizer, log)
    train = train[: config.data.num_samples]
    log(f"regenerate: {len(train)} training prompts, {len(heldout)} held out for the benchmark")
    log_projection(config.run, config.data, config.target, config.training, log)
    if len(train) < config.data.num_samples:
        log(f"regenerate: the source holds only {len(train)} training prompts (data.num_samples is {config.data.num_samples})")

    generator = generator or make_generator(config.data, config.target, config.training.seed)
    done = read_done(out)
    todo = [(index, prompt) for index, prompt in enumerate(train) if prompt.id not in done]
    if done:
        log(f"regenerate: resuming, {len(train) - len(todo)} samples already written")
    todo = take_stored(store, todo, out, config.run, config.data, log)
    progress = Progress("regenerate", total=len(train), done=len(train) - len(todo), unit="samples", log=log)
    batch_size = engine_batch(config.data)
    for start in range(0, len(todo), batch_size):
        batch = todo[start : start + batch_size]
        records = generate_batch(generator, tokenizer, [p for _, p in batch], config.data)
        append_records(out, [(index, record) for (index, _), record in zip(batch, records)], config.data.shard_samples)
        progress.advance(len(batch), tokens=sum(len(r["input_ids"]) for r in records))

    greedy = continue_heldout(continuing(config), generator, tokenizer, out / GREEDY_FILE, log)
    atomic_write_json(out / IDS_FILE, [p.id for p in train])  # in split order: more samples append to it
    stale = len(read_done(out) - {p.id for p in train})
    if stale:
        log(f"regenerate: ignoring {stale} sample(s) written by an earlier run for prompts outside this split")
    quality = check_quality(config.data, out, tokenizer, log)
    fields = samples_fields(config.run, config.data, config.target, config.production.telemetry.slice_label, out,
                            tokenizer, prompt_set, len(heldout), greedy, quality, generator.release)
    write_manifest(out, kind="regenerated", fields=fields)
    log(f"regenerate: {fields['samples']} samples, {fields['tokens']} tokens ({fields['loss_tokens']} generated by the "
        f"target) in {out}")
    refuse_failed(quality, str(out))
    if store is not None:  # only replies that passed the quality bars are shared
        kept = store.publish(read_regenerated(out), str(config.run.data_dir.resolve()))
        log(f"regenerate: sample store {store.where}: {kept} new replies kept for later runs")
    return out


def take_stored(store, todo: list[tuple[int, Prompt]], out: Path, run: RunSection, data: DataSection,
                log: Log) -> list[tuple[int, Prompt]]:
    """Write the replies the sample store holds for `todo`'s prompts into the shards, as they stream in; return the
    prompts left to answer."""
    if store is None or not todo:
        return todo
    index_of = {prompt.id: index for index, prompt in todo}
    answered: set[str] = set()
    batch: list[tuple[int, dict]] = []
    for record in store.take(list(index_of), str(run.data_dir.resolve())):
        answered.add(record["id"])
        batch.append((index_of[record["id"]], record))
        if len(batch) == data.shard_samples:
            append_records(out, batch, data.shard_samples)
            batch = []
    append_records(out, batch, data.shard_samples)
    left = [(index, prompt) for index, prompt in todo if prompt.id not in answered]
    log(f"regenerate: sample store {store.where}: {len(answered)} of {len(todo)} replies taken from earlier runs, "
        f"{len(left)} to generate")
    return left


def engine_batch(data: DataSection) -> int:
    """Prompts sent at once: a local batch, or as many as the servers take concurrently."""
    return data.batch_size if data.generator == "local" else data.concurrency


def split_prompts(run: RunSection, data: DataSection, target: TargetSection, slice_label: str, tokenizer,
                  log: Log) -> tuple[PromptSet, list[Prompt], list[Prompt]]:
    """The prompt source, its training and held-out prompts - with data.traffic, mixed with production's traffic
    prompts (`slice_label`: production.telemetry's), each side split the same way; the held-out ones are written for
    the benchmark and the malformed lines reported."""
    data_dir = run.stage_dir("data")
    prompt_set = load_prompts(data.prompts)
    report_malformed(prompt_set, data_dir / MALFORMED_FILE, log)
    train, heldout = split_heldout(prompt_set.prompts, data.heldout_fraction)
    if data.traffic is not None:
        made, traffic = traffic_prompts(run, data, target, slice_label, tokenizer)
        log(f"prompts: production traffic: {describe_traffic(made)}")
        traffic_train, traffic_heldout = split_heldout(traffic, data.heldout_fraction)
        train = mixed(train, traffic_train, data.traffic.share)
        heldout = mixed(heldout, traffic_heldout, data.traffic.share)
        ids = {p.id for p in traffic}
        used = sum(p.id in ids for p in train[: data.num_samples])
        log(f"prompts: {used} of the first {min(len(train), data.num_samples)} training prompts and "
            f"{sum(p.id in ids for p in heldout)} of {len(heldout)} held-out prompts come from production traffic "
            f"({data.traffic.records}, share {data.traffic.share}); the rest from {data.prompts}")
    heldout = fitting_prompts(heldout, tokenizer, data, log)
    write_prompts(data_dir / HELDOUT_FILE, heldout)
    return prompt_set, train, heldout


def fitting_prompts(prompts: list[Prompt], tokenizer, data: DataSection, log: Log) -> list[Prompt]:
    """The held-out prompts shorter than data.max_length, as training sends them (a longer one gets no reply there):
    the draft is trained on positions below it, so the benchmark measures it there too."""
    limit = data.max_length
    fitting = [p for p in prompts if len(sent_ids(tokenizer, p, data.thinking)) < limit]
    if len(fitting) < len(prompts):
        log(f"regenerate: {len(prompts) - len(fitting)} of {len(prompts)} held-out prompts are data.max_length "
            f"({limit}) tokens or longer and left out of the benchmark, as training leaves them out")
    return fitting


def sent_ids(tokenizer, prompt: Prompt, thinking: bool) -> list[int]:
    """The ids the target is sent for a prompt: a rendered prompt's text as it is (its template is applied already),
    else its turns through the chat template."""
    if prompt.text is not None:
        return encode(tokenizer, prompt.text)
    return render_prompt_ids(tokenizer, list(prompt.turns), thinking)


def samples_fields(run: RunSection, data: DataSection, target: TargetSection, slice_label: str, directory: Path,
                   tokenizer, prompt_set: PromptSet, heldout: int, greedy: dict, quality: dict,
                   release: str | None) -> dict:
    """The manifest fields of a finished samples directory (regenerated or imported): what later stages check, and
    the counts of the training split's samples (`slice_label`: production.telemetry's, naming traffic prompts)."""
    samples = tokens = loss_tokens = ended_early = 0
    for record in read_regenerated(directory):
        ended_early += bool(record.get("ended_early"))
        samples += 1
        tokens += len(record["input_ids"])
        loss_tokens += sum(record["loss_mask"])
    return {
        "target": target_identity(target),
        "chat_template_sha256": chat_template_hash(tokenizer),
        "thinking": data.thinking,
        "engine": data.generator,
        "engine_release": release,
        "source": data.prompts,
        "prompt_sources": prompt_sources(run, data, target, slice_label, training_ids(directory)),
        "sampling": {"temperature": data.temperature, "max_new_tokens": data.max_new_tokens},
        "max_length": data.max_length,
        "samples": samples,
        "tokens": tokens,
        "loss_tokens": loss_tokens,
        "heldout_prompts": heldout,
        # the suites stage reads the held-out prompts file too (its traffic suite): its content is pinned here
        "heldout_prompts_sha256": sha256_file(run.stage_dir("data") / HELDOUT_FILE),
        "heldout_greedy": greedy,
        "malformed_lines": len(prompt_set.malformed),
        "duplicate_prompts": prompt_set.duplicates,
        "ended_early": ended_early,
        "quality": quality,
        "code_version": code_version(),
    }


def check_quality(data: DataSection, directory: Path, tokenizer, log: Log) -> dict:
    """The data-quality report of the regenerated replies (eagle3.data.quality), logged; waived problems named."""
    quality = report(regenerated_replies(directory, tokenizer), data.quality, data.max_new_tokens,
                     tokenizer.decode)
    log(f"regenerate: data quality: {describe_figures(quality['figures'])}")
    for problem in quality["problems"]:
        log(f"regenerate: data quality {'WAIVED' if problem['waived'] else 'FAILED'} ({problem['code']}): "
            f"{problem['message']}")
    return quality


def regenerated_replies(directory: Path, tokenizer):
    """Every reply of the training split's samples (ids cut where a sample was cut at max_length)."""
    for record in read_regenerated(directory):
        if "replies" not in record:
            raise UnreadableInput(f"{directory}: sample {record['id']} was written by an eagle3 that did not record its "
                                  f"replies; remove {directory} and regenerate")
        for start, end, finish in record["replies"]:
            ids = tuple(record["input_ids"][start:end])
            # an imported reply has no finish reason (None): whether it hit a limit is unknown
            yield Reply(ids, tokenizer.decode(ids, skip_special_tokens=True), None if finish is None else finish == "length")


@dataclass(frozen=True)
class Continuing:
    """What the benchmark's greedy continuations read of a run's config: which questions, how they are continued."""

    run: RunSection  # the held-out prompts the data stage wrote
    benchmark: BenchmarkSection | None  # its suites; None: the held-out prompts alone
    heldout_prompts: int  # heldout_set's: how many held-out prompts without a benchmark section
    data: DataSection  # the engine (a local one, or data.nodes' servers), its batch, data.thinking
    target: TargetSection
    seed: int  # training.seed: a local engine's
    max_new_tokens: int  # each answer's (heldout_set's): a multi-turn question's later turns follow them
    length: int  # each continuation's (greedy_length)


def continuing(config: PipelineConfig) -> Continuing:
    """The continuations' spec of a config (the greedy length reads every draft the run trains)."""
    return Continuing(config.run, config.benchmark, config.heldout_set[0], config.data, config.target,
                      config.training.seed, config.heldout_set[1], greedy_length(config))


def greedy_length(config: PipelineConfig) -> int:
    """A verify step can accept drafts past max_new_tokens and past EOS, and SGLang counts them: the continuation
    runs as many tokens further as the deepest drafting shape simulated (serving's and the sweep's, of every draft the
    run trains: its contenders read the same continuations) and ignores EOS."""
    drafts = draft_configs(config).values()
    return config.heldout_set[1] + max(s.num_steps for d in drafts for s in simulated_shapes(d.replay_shape, d.sweep))


def simulated_shapes(replay: DraftShape, sweep: SweepSection) -> list[DraftShape]:
    """The drafting shapes the simulator replays: serving's (or the replay's: a config's replay_shape), then
    sweep.points, without repeats."""
    shapes = [replay] + [DraftShape(*point) for point in sweep.points]
    return list(dict.fromkeys(shapes))


def benchmark_questions(spec: Continuing, held_out: bool) -> list[Question]:
    """The held-out suite's questions (`held_out`: what training replays, made with the training replies) or every
    other configured suite's (the suites stage's, eagle3.data.continuations); a config without a benchmark section has
    the held-out prompts alone."""
    heldout = heldout_prompts_file(spec.run.stage_dir("data") / HELDOUT_FILE)
    if spec.benchmark is None:
        return [Question(HELDOUT, prompt, False) for prompt in heldout[: spec.heldout_prompts]] if held_out else []
    suites = [suite for suite in spec.benchmark.suites if (suite.name == HELDOUT) == held_out]
    return suite_questions(spec.benchmark.model_copy(update={"suites": suites}), heldout)


def continue_heldout(spec: Continuing, generator, tokenizer, path: Path, log: Log) -> dict:
    """The held-out suite's greedy continuations (`continue_benchmark`)."""
    return continue_benchmark(spec, benchmark_questions(spec, held_out=True), generator, tokenizer, path, log)


def continue_benchmark(spec: Continuing, questions: list[Question], generator, tokenizer, path: Path,
                       log: Log) -> dict:
    """The target's greedy continuation of every request of `questions`, once (the simulator replays drafting over
    them: for a greedy target the accepted tokens are exactly these; the served benchmark sends the same prompt ids).
    Kept when already made for the same questions, answers' length and continuation length; `generator` (None: one
    made here) is asked only when they must be made."""
    made = kept_continuations(spec, questions, path)
    if made is not None:
        return greedy_fields(made)
    generator = generator or make_generator(spec.data, spec.target, spec.seed)
    length, key, thinking = spec.length, continuations_key(spec, questions), spec.data.thinking
    progress = Progress("held-out continuations", total=sum(q.requests for q in questions), unit="requests", log=log)
    batch_size = engine_batch(spec.data)

    def continue_greedy(prompts: list[list[int]]) -> list[list[int]]:
        continuations = []
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start : start + batch_size]
            continuations += generator.continue_greedy(batch, length)
            progress.advance(len(batch), tokens=length * len(batch))
        return continuations

    rows = continue_questions(questions, tokenizer, thinking, lambda prompt: sent_ids(tokenizer, prompt, thinking),
                              continue_greedy, spec.max_new_tokens, target_eos_ids(spec.target.path), log)
    atomic_write_bytes(path, "".join(json.dumps({**row, "key": key}) + "\n" for row in rows).encode())
    fields = greedy_fields(rows)
    log(f"regenerate: greedy continuations of {fields['requests']} benchmark requests ({length} tokens each; "
        f"{fields['suites']}) in {path}")
    return fields


def continuations_key(spec: Continuing, questions: list[Question]) -> str:
    """What continuations are made for: the questions, the answers' length and the continuations'."""
    return hashlib.sha256(json.dumps([[[q.suite, q.prompt.id, q.prompt.slice, q.multi_turn] for q in questions],
                                      spec.length, spec.max_new_tokens]).encode()).hexdigest()


def kept_continuations(spec: Continuing, questions: list[Question], path: Path) -> list[dict] | None:
    """The rows at `path` when they were made for `questions` and these lengths, else None."""
    key = continuations_key(spec, questions)
    made = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    current = path.is_file() and (made or not questions) and all(row.get("key") == key for row in made)
    return made if current else None


def greedy_fields(rows: list[dict]) -> dict:
    """The manifest's account of the benchmark's greedy continuations: held-out prompts, length, requests per suite."""
    suites: dict[str, int] = {}
    for row in rows:
        suites[row["suite"]] = suites.get(row["suite"], 0) + 1
    return {"prompts": suites.get(HELDOUT, 0), "length": len(rows[0]["continuation_ids"]) if rows else 0,
            "requests": len(rows), "suites": suites}


def read_greedy(directory: Path) -> list[dict]:
    """The greedy sequences `directory` holds (regen_dir's, or the suites stage's): {id, question, turn, suite, slice,
    prompt_ids, continuation_ids} per request."""
    path = Path(directory) / GREEDY_FILE
    if not path.is_file():
        raise UnreadableInput(f"{path}: no greedy continuations of the benchmark's requests; run `eagle3 data "
                              "regenerate` again")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def generate_batch(generator, tokenizer, prompts: list[Prompt], data: DataSection) -> list[dict]:
    """Run every prompt of the batch turn by turn; each round sends one prompt per unfinished sample."""
    max_length = data.max_length
    builders = {p.id: SampleBuilder(tokenizer, list(p.turns), data.thinking, p.text) for p in prompts}
    ended_early: set[str] = set()
    finishes: dict[str, list[str]] = {}
    active = dict(builders)
    while active:
        requests = {}
        for pid, builder in active.items():
            try:
                ids = builder.next_prompt()
            except TemplateMismatch:
                ended_early.add(pid)
                continue
            if ids is not None and len(ids) < max_length:  # no room left: the sample ends here
                requests[pid] = ids
        if not requests:
            break
        for pid, generation in zip(requests, generator.generate(list(requests.values()))):
            builders[pid].add_reply(generation.output_ids)
            finishes.setdefault(pid, []).append(generation.finish_reason)
        active = {pid: builders[pid] for pid in requests}
    records = []
    for prompt in prompts:
        sample = builders[prompt.id].sample(max_length)
        record = {"id": prompt.id, "conversation": sample.conversation, "input_ids": sample.input_ids,
                  "loss_mask": sample.loss_mask,
                  # each reply's [start, end) in input_ids and why the engine stopped it, for the quality report
                  "replies": [[*span, finish] for span, finish in zip(sample.replies, finishes.get(prompt.id, []))]}
        if prompt.id in ended_early:
            record["ended_early"] = True  # the template rewrote history: later turns were dropped
        records.append(record)
    return records


def append_records(out: Path, indexed: list[tuple[int, dict]], shard_samples: int) -> None:
    """Append whole lines (flushed) to the shard each sample's index belongs to."""
    by_shard: dict[int, list[str]] = {}
    for index, record in indexed:
        # compact separators: ~8.3 bytes per token at a 163,840-id vocabulary instead of ~10.3
        line = json.dumps(record, ensure_ascii=False, separators=(",", ":"))
        by_shard.setdefault(index // shard_samples, []).append(line + "\n")
    for shard, lines in sorted(by_shard.items()):
        with open(shard_path(out, shard), "a") as f:
            f.write("".join(lines))
            f.flush()


def report_malformed(prompt_set, path: Path, log: Log) -> None:
    atomic_write_json(path, {"source": prompt_set.source, "malformed": prompt_set.malformed})
    if prompt_set.malformed:
        shown = "; ".join(f"line {n}: {why}" for n, why in prompt_set.malformed[:5])
        more = f" (+{len(prompt_set.malformed) - 5} more, all in {path})" if len(prompt_set.malformed) > 5 else ""
        log(f"prompts: {len(prompt_set.malformed)} malformed line(s) skipped in {prompt_set.source}: {shown}{more}")
