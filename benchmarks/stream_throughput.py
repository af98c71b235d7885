"""Streamed features on a real model: SmolLM2-135M (configs/smollm2-cpu.yaml) on this CPU, one torch thread per process.

1. The Mooncake round trip of one sample's features at SmolLM2's width, [T, (3 aux + 1) x 576], T 512 and 2048, bf16
   and float32: a master started here, a segment owner in its own process (as the coordinator) and a pure client
   (as a worker putting and a trainer getting).
2. Capture: samples/s and tokens/s of 1 and 2 capture workers (the local transformers prefill and the put), started
   by the stream's own session, the samples announced as a trainer announces them.
3. Training, eagle3.train.launch.train with one trainer rank, the same batches: features computed in the rank
   (online), streamed from 1 and from 2 capture workers, and, where a prepared run holds offline feature shards, read
   from those (the draft step with no target in it). Which bounds the streamed trainer, and the round trip's share of
   its step.

The samples are a prepared run's regenerated ones (runs/smollm2-cpu or runs/smollm2-contenders-cpu), else a short
regeneration here. On 2 cores, 2 workers and a trainer are 3 busy processes: they share the cores, which the figures
show. Everything runs under a temporary directory, removed at the end.

    python benchmarks/stream_throughput.py [--quick] [--target runs/targets/smollm2] [--prepared RUN_DIR]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from eagle3.config import resolved_config_file
from eagle3.config.stream import StreamSection
from eagle3.data.capture import HIDDEN_DIR, capture, capture_settings, dataset_dir
from eagle3.data.regenerate import regen_dir, regenerate
from eagle3.data.vocab import build_vocab
from eagle3.resolve import load_config
from eagle3.runtime.sglang_features import free_port
from eagle3.stream.coordinator import CoordinatorClient
from eagle3.stream.session import streaming
from eagle3.stream.store import GIB, QUIET_CLIENT, Store, content_key, feature_settings, start_master
from eagle3.train.data import TrainingData
from eagle3.train.launch import train

CONFIG = Path(__file__).parent.parent / "configs" / "smollm2-cpu.yaml"
PREPARED = ("runs/smollm2-cpu", "runs/smollm2-contenders-cpu")  # runs whose regenerated samples are reused
FALLBACK_SAMPLES = 24  # regenerated here when no prepared run is found (~0.27 samples/s)
MB = 1e6
SEGMENT_GIB = 1.0  # the round trip's segment owner: every repetition of one shape fits
# the trainers' store: far above what these runs hold at once (~2.6 MB a sample), so the watermarks never pause
STORE = ["training.stream.store_gib=1", "training.stream.high_watermark_gib=0.5",
         "training.stream.low_watermark_gib=0.25"]


class Log:
    """The pipeline's lines, kept for the end (printed when something failed) instead of drowning the figures."""

    def __init__(self):
        self.lines: list[str] = []

    def __call__(self, line: str) -> None:
        self.lines.append(line)

    def tail(self, count: int = 40) -> str:
        return "\n".join(self.lines[-count:])


def stream_ports() -> list[str]:
    return [f"training.stream.master_port={free_port()}", f"training.stream.metadata_port={free_port()}",
            f"training.stream.coordinator_port={free_port()}"]


# -- 1. the round trip ---------------------------------------------------------------------------


def hold_segment(stream: StreamSection, segment_bytes: int, ready, done) -> None:
    """The coordinator's part: a client that lends the store its memory, until `done`."""
    store = Store(stream, stream.host, segment_bytes)
    ready.set()
    done.wait()
    store.close()


def round_trip(work: Path, repeats: int, width: int) -> list[dict]:
    """Put then get of [T, width] features, T 512 and 2048, bf16 and float32, through a segment in another process."""
    stream = StreamSection(master_port=free_port(), metadata_port=free_port())
    master = start_master(stream, work / "mooncake-master.log")
    spawn = multiprocessing.get_context("spawn")
    ready, done = spawn.Event(), spawn.Event()
    owner = spawn.Process(target=hold_segment, args=(stream, int(SEGMENT_GIB * GIB), ready, done))
    owner.start()
    try:
        if not ready.wait(60):
            raise RuntimeError("the segment owner did not join the Mooncake store within 60 s")
        client = Store(stream, stream.host)
        try:
            return [one_shape(client, tokens, dtype, width, repeats)
                    for tokens in (512, 2048) for dtype in (torch.bfloat16, torch.float32)]
        finally:
            client.close()
    finally:
        done.set()
        owner.join(30)
        master.terminate()
        master.wait(30)


def one_shape(client: Store, tokens: int, dtype: torch.dtype, width: int, repeats: int) -> dict:
    features = torch.randn(tokens, width).to(dtype)
    keys = [f"bench/{tokens}/{dtype}/{i}" for i in range(repeats + 1)]
    client.put(keys[0], features)  # the first transfer of a shape sets up buffers: not timed
    client.get(keys[0])
    started = time.perf_counter()
    for key in keys[1:]:
        client.put(key, features)
    put_s = (time.perf_counter() - started) / repeats
    started = time.perf_counter()
    for key in keys[1:]:
        got = client.get(key)
    get_s = (time.perf_counter() - started) / repeats
    if not torch.equal(got, features):
        raise RuntimeError(f"the store gave back other features than were put ({tokens} x {width}, {dtype})")
    for key in keys:
        client.remove(key)
    size = features.numel() * features.element_size()
    return {"tokens": tokens, "dtype": str(dtype).removeprefix("torch."), "bytes": size, "put_s": put_s,
            "get_s": get_s}


# -- the data set -------------------------------------------------------------------------------


def prepared_run(given: str | None) -> Path | None:
    """The run whose regenerated samples are reused: --prepared, else the first of PREPARED that holds them."""
    candidates = [given] if given else PREPARED
    for candidate in candidates:
        if (Path(candidate) / "data" / "regen" / "manifest.json").is_file():
            return Path(candidate)
    if given:
        raise SystemExit(f"--prepared {given}: no regenerated samples in {given}/data/regen")
    return None


def make_data(base: list[str], data_run: Path, prepared: Path | None, log: Log) -> None:
    """Regenerated samples (a prepared run's, else made here), the draft vocabulary, the token rows and the held-out
    features, as the train stage finds them."""
    overrides = [*base, f"run.dir={data_run}", "training.features=streamed"]
    if prepared is None:
        print(f"no prepared run ({', '.join(PREPARED)}): regenerating {FALLBACK_SAMPLES} samples here", flush=True)
        overrides.append(f"data.num_samples={FALLBACK_SAMPLES}")
    config = load_config(CONFIG, overrides)
    if prepared is None:
        regenerate(config, log=log)
    else:
        shutil.copytree(prepared / "data" / "regen", regen_dir(config.run))
    build_vocab(config.run, config.data, config.target, config.vocab, log=log)
    capture(config.run, config.data, config.target, config.training, log=log)


def run_dir_over(data_run: Path, run_dir: Path, hidden: Path | None = None) -> Path:
    """A run directory that reads `data_run`'s data and vocabulary and trains on its own; `hidden`: offline feature
    shards to read as its data set."""
    (run_dir / "logs").mkdir(parents=True)  # the stream's session writes the master's log there
    os.symlink(data_run / "vocab", run_dir / "vocab")
    if hidden is None:
        os.symlink(data_run / "data", run_dir / "data")
    else:
        (run_dir / "data").mkdir()
        for part in (data_run / "data").iterdir():
            os.symlink(part, run_dir / "data" / part.name)
        os.symlink(hidden.resolve(), run_dir / "data" / HIDDEN_DIR)
    return run_dir


# -- 2. capture ---------------------------------------------------------------------------------


def capture_rate(base: list[str], data_run: Path, work: Path, workers: int, samples: int, log: Log) -> dict:
    """Capture workers started by the stream's session; the samples announced as the trainer announces them (its
    first epoch's batches, in order). A first round (a claim for each worker) loads the workers' targets and is not
    timed."""
    run_dir = run_dir_over(data_run, work / f"capture-{workers}")
    config = load_config(CONFIG, [*base, f"run.dir={run_dir}", "training.features=streamed", *stream_ports(), *STORE,
                                  f"training.stream.workers_per_host={workers}"])
    resolved = resolved_config_file(config)
    data = TrainingData(dataset_dir(config.run, config.training), config.training.seq_len,
                        config.training.eval_fraction)  # the trainer's split and order: its batches' padding
    settings = feature_settings(capture_settings(config.data, config.target))
    warm = workers * config.training.stream.capture_batch
    train = config.training
    refs = [ref for batch in data.batches(0, train.batch_size, train.seed) for ref in batch][: warm + samples]
    tokens = data.tokens(refs)[0]
    items = [{"key": content_key(settings, tokens.input_ids[i, : ref.length]), "sample_id": ref.id,
              "length": ref.length} for i, ref in enumerate(refs)]
    with streaming(config.run, config.data, config.training, resolved, log) as session:
        client = CoordinatorClient(config.training.stream)
        try:
            client.call("want", items=items[:warm], priority=1, first_position=0)
            wait_captured(session, warm)
            started = time.perf_counter()
            client.call("want", items=items[warm:], priority=1, first_position=warm)
            wait_captured(session, warm + samples)
            seconds = time.perf_counter() - started
        finally:
            client.close()
    return {"workers": workers, "samples": samples, "tokens": sum(ref.length for ref in refs[warm:]),
            "seconds": seconds}


def wait_captured(session, count: int) -> None:
    while session.ledger.totals().captures < count:
        if session.failure:
            raise RuntimeError(f"the stream failed: {session.failure}")
        if not session.coordinator.alive():
            raise RuntimeError(f"no capture worker is alive: {session.coordinator.workers}")
        time.sleep(0.05)


# -- 3. training --------------------------------------------------------------------------------


def training_rate(base: list[str], run_dir: Path, features: list[str], log: Log) -> dict:
    """One trainer rank through the train stage's launch; its steps' times from metrics.jsonl (the first step, which
    waits for the first features, left out)."""
    config = load_config(CONFIG, [*base, f"run.dir={run_dir}", *features])
    started = time.perf_counter()
    train(config.run, config.data, config.training, None, resolved_config_file(config), log)
    wall = time.perf_counter() - started
    steps = [record for record in read_metrics(run_dir) if "step_time_s" in record]
    steady = [record["step_time_s"] for record in steps[1:]]
    return {"step_s": statistics.mean(steady), "median_step_s": statistics.median(steady), "steps": len(steady),
            "losses": [record["loss"] for record in steps], "wall_s": wall,
            "samples_per_step": config.training.batch_size}


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()]


# -- the report ---------------------------------------------------------------------------------


DRAFT_ONLY = "offline shards (the draft step alone)"


def streamed_name(workers: int) -> str:
    return f"streamed, {workers} capture worker{'s' if workers > 1 else ''}"


def report_round_trip(rows: list[dict], width: int) -> None:
    print(f"1. Mooncake round trip of one sample's features [T, {width}] (TCP on 127.0.0.1; the segment in another "
          "process)")
    for r in rows:
        trip = r["put_s"] + r["get_s"]
        print(f"   T {r['tokens']:>4} {r['dtype']:<8} {r['bytes'] / MB:6.1f} MB: put {r['put_s'] * 1e3:6.2f} ms "
              f"({r['bytes'] / r['put_s'] / MB:6.0f} MB/s), get {r['get_s'] * 1e3:6.2f} ms "
              f"({r['bytes'] / r['get_s'] / MB:6.0f} MB/s), round trip {trip * 1e3:6.2f} ms "
              f"({r['bytes'] / trip / MB:6.0f} MB/s)")


def report_capture(rows: list[dict]) -> None:
    print("2. Capture (prefill with the local transformers target + put), samples announced ahead")
    for r in rows:
        print(f"   {r['workers']} worker(s): {r['samples']} samples ({r['tokens']:,} tokens) in {r['seconds']:.1f} s: "
              f"{r['samples'] / r['seconds']:.2f} samples/s, {r['tokens'] / r['seconds']:,.0f} tokens/s")
    if len(rows) == 2:
        one, two = (r["samples"] / r["seconds"] for r in rows)
        print(f"   2 workers / 1 worker: {two / one:.2f}x")


def report_training(runs: dict[str, dict], captures: list[dict], trip: dict, width: int, mean_tokens: float) -> None:
    print("3. Training, one trainer rank, the same batches (steady steps: the first left out)")
    for name, r in runs.items():
        print(f"   {name:<34} {r['step_s']:6.2f} s/step (median {r['median_step_s']:.2f}, {r['steps']} steps): "
              f"{r['samples_per_step'] / r['step_s']:.2f} samples/s; whole launch {r['wall_s']:.0f} s")
    online = runs["online (features in-rank)"]
    for name, r in runs.items():
        if name.startswith("streamed"):
            print(f"   {name} / online: {online['step_s'] / r['step_s']:.2f}x samples/s; losses max |diff| "
                  f"{max(abs(a - b) for a, b in zip(r['losses'], online['losses'])):.2e}")
    draft = runs.get(DRAFT_ONLY)
    batch = online["samples_per_step"]
    if draft is not None:
        for c in captures:
            capture_s = batch * c["seconds"] / c["samples"]  # a step's samples captured by the workers alone
            bound = "capture" if capture_s > draft["step_s"] else "the draft step"
            streamed = runs[streamed_name(c["workers"])]
            print(f"   {c['workers']} worker(s): a step's {batch} samples take {capture_s:.2f} s to capture, the draft "
                  f"step {draft['step_s']:.2f} s: the bound is {bound} (max {max(capture_s, draft['step_s']):.2f} s; "
                  f"measured {streamed['step_s']:.2f} s/step streamed)")
    step_bytes = batch * mean_tokens * width * 4  # float32: the target's dtype on this CPU
    get_s, put_s = step_bytes * trip["get_s"] / trip["bytes"], step_bytes * trip["put_s"] / trip["bytes"]
    streamed = runs[streamed_name(1)]
    print(f"   Mooncake round trip of a step's features ({batch} x {mean_tokens:.0f} tokens, float32: "
          f"{step_bytes / MB:.1f} MB) at part 1's T 512 float32 rates: get {get_s * 1e3:.1f} ms in the trainer's step "
          f"({get_s / streamed['step_s']:.2%} of a streamed step), put {put_s * 1e3:.1f} ms in the workers' "
          f"({put_s / (batch * captures[0]['seconds'] / captures[0]['samples']):.2%} of their capture)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="runs/targets/smollm2")
    parser.add_argument("--prepared", default=None, help="a run directory whose data/regen to reuse (default: the "
                        f"first of {', '.join(PREPARED)} that has one)")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, samples and steps")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (its logs)")
    args = parser.parse_args()
    repeats, samples, steps = (5, 8, 4) if args.quick else (20, 16, 10)
    # Mooncake logs every client's set-up at INFO; this release reads its level from MC_LOG_LEVEL (QUIET_CLIENT's
    # GLOG_minloglevel alone leaves the lines in)
    os.environ.update({**QUIET_CLIENT, "MC_LOG_LEVEL": "ERROR"})
    torch.set_num_threads(1)
    prepared = prepared_run(args.prepared)
    work = Path(tempfile.mkdtemp(prefix="eagle3-stream-bench-"))
    log = Log()
    base = [f"target.path={args.target}", "run.cpu_threads=1", "training.nproc_per_node=1",
            f"training.max_steps={steps}", f"training.eval_every={steps}", f"training.save_every={steps}",
            "training.best_by=step_acc", "training.eval_fraction=0.02"]  # one short evaluation, at the end
    try:
        config = load_config(CONFIG, [*base, f"run.dir={work / 'data-run'}", "training.features=streamed"])
        width = (len(config.data.aux_layers) + 1) * config.target.hidden_size
        print(f"SmolLM2-135M ({args.target}), {os.cpu_count()} CPU(s), one torch thread per process; samples from "
              f"{prepared or 'a regeneration here'}; load average {os.getloadavg()[0]:.1f}", flush=True)
        trips = round_trip(work, repeats, width)
        report_round_trip(trips, width)
        data_run = work / "data-run"
        make_data(base, data_run, prepared, log)
        captures = [capture_rate(base, data_run, work, workers, samples, log) for workers in (1, 2)]
        report_capture(captures)
        runs = {"online (features in-rank)": training_rate(base, run_dir_over(data_run, work / "online"),
                                                           ["training.features=online"], log)}
        for workers in (1, 2):
            runs[streamed_name(workers)] = training_rate(
                base, run_dir_over(data_run, work / f"streamed-{workers}"),
                ["training.features=streamed", *stream_ports(), *STORE, f"training.stream.workers_per_host={workers}"],
                log)
        hidden = prepared / "data" / HIDDEN_DIR if prepared else None
        if hidden is not None and (hidden / "manifest.json").is_file():
            runs[DRAFT_ONLY] = training_rate(
                base, run_dir_over(data_run, work / "offline", hidden), ["training.features=offline"], log)
        data = TrainingData(dataset_dir(config.run, config.training), config.training.seq_len, 0.0)
        mean_tokens = statistics.mean(ref.length for ref in data.train)
        trip = next(r for r in trips if r["tokens"] == 512 and r["dtype"] == "float32")
        report_training(runs, captures, trip, width, mean_tokens)
        print(f"load average at the end {os.getloadavg()[0]:.1f} (other jobs share these cores)")
    except BaseException:
        print(log.tail(), flush=True)
        raise
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
