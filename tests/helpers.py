"""Helpers the test modules share (imported from here, never from another test module)."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import time
from datetime import datetime
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from safetensors.torch import load_file, save_file

from eagle3.bench.simulate import target_greedy
from eagle3.config import RESOLVED_FILE
from eagle3.resolve import load_config
from eagle3.data.capture import capture
from eagle3.data.conversation import prompt_ids
from eagle3.data.prompts import pydoc_prompt_turns
from eagle3.data.continuations import suites_dir
from eagle3.data.regenerate import (GREEDY_FILE, HELDOUT_FILE, REGEN_DIR, benchmark_questions, continue_benchmark,
                                    continue_heldout, continuing, regenerate)
from eagle3.data.vocab import build_vocab
from eagle3.deployment.monitor import Monitor
from eagle3.algorithms.eagle3.checkpoint import DraftConfig
from eagle3.draft.vocab_map import build_vocab_map
from eagle3.runtime.generators import make_generator
from eagle3.runtime.targets import load_tokenizer
from eagle3.algorithms.eagle3.model import Eagle3Draft
from eagle3.model.blocks import init_weights
from eagle3.model.weights import target_head
from eagle3.registry.registry import open_registry
from eagle3.runs import retrain_dir
from eagle3.serve.inprocess import serve_in_thread
from eagle3.serve.reference import create_app
from eagle3.stages.table import Stage, StageRun, output_of
from ports import free_port


# ---- Configs and run directories

ROOT = Path(__file__).parent.parent


TINY = ROOT / "configs" / "tiny-cpu.yaml"


KIMI = ROOT / "configs" / "kimi-k25-8xh200.yaml"


def micro_overrides(run_dir, target):
    return [
        f"run.dir={run_dir}",
        f"target.path={target}",
        "target.hidden_size=64",
        "target.vocab_size=512",
        "vocab.draft_vocab_size=128",
        "data.num_samples=24",
        "data.max_new_tokens=24",
        "data.max_length=96",
        "data.batch_size=8",
        "data.shard_samples=10",
        # the micro target (held-out loss ~2.9) answers a sixth to two fifths of the prompts with newlines only,
        # which the default bars refuse: its tests waive those two checks on purpose (a degenerate target still
        # fails the others: test_quality.py)
        "data.quality.waive=[empty-replies, duplicate-replies]",
    ]


def micro_run_overrides(run_dir, target) -> list[str]:
    """The tiny config shrunk to the micro target: a full flow run in well under a minute on 2 cores. Training
    computes the target's features online (the offline path runs in test_data, test_train and the deployment test)."""
    return micro_overrides(run_dir, target) + ["training.features=online",
        "training.max_steps=30", "training.batch_size=8", "training.seq_len=96", "training.warmup_steps=5",
        "training.eval_every=15", "training.save_every=15", "benchmark.num_prompts=4", "benchmark.max_new_tokens=24",
        "benchmark.concurrency=2", f"serving.port={free_port()}", f"production.port={free_port()}",
        f"registry.path={run_dir / 'registry'}", f"production.state_dir={run_dir / 'production'}",
        f"serving.log_dir={run_dir / 'logs'}", "gate.min_accept_rate=0.05",
        # the sweep serves three more servers (~25 s): only the micro flow's first run makes it (SWEEP)
        "sweep.points=[[2, 2, 4]]", "sweep.num_prompts=2", "sweep.enabled=false",
        # two suites: the held-out prompts, and MT-bench's first two questions (two turns each: four requests)
        "benchmark.suites=[heldout, {name: mtbench, num_prompts: 2}]", "gate.min_verify_steps=5",
        # no throughput rule: under pytest-xdist another worker's load falls on the baseline or the candidate by
        # chance (measured: a good draft at 0.40x); the rule's own test below sets a bar out of reach
        "gate.min_speedup=0",
    ]


TRAIN = ["data.num_samples=64", "training.batch_size=8", "training.seq_len=96", "training.warmup_steps=5",
         "training.eval_every=10", "training.save_every=2", "training.ttt_steps=3", "benchmark.num_prompts=8"]


def build_micro_data(run_dir, micro_target):
    """Regenerated, captured (offline features and online token shards) and vocab-mapped micro data, shared by the
    trainer tests of every module (the `micro_data` fixture in conftest.py)."""
    config = load_config(TINY, micro_overrides(run_dir, micro_target) + TRAIN)
    quiet = lambda line: None  # noqa: E731
    regenerate(config, log=quiet)
    capture(config.run, config.data, config.target, config.training, log=quiet)
    online = load_config(TINY, micro_overrides(run_dir, micro_target) + TRAIN + ["training.features=online"])
    capture(online.run, online.data, online.target, online.training, log=quiet)
    build_vocab(config.run, config.data, config.target, config.vocab, log=quiet)
    return run_dir, micro_overrides(run_dir, micro_target) + TRAIN


def run_copy(micro_data, tmp_path, name, extra=()):
    """A run directory that shares the data stage's outputs but trains on its own."""
    run_dir, overrides = micro_data
    target = tmp_path / name
    target.mkdir()
    for stage in ("data", "vocab"):
        os.symlink(run_dir / stage, target / stage)
    return [*overrides, f"run.dir={target}", *extra], target


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()]


# ---- Drafts on disk and in memory

RELEASE = "0.5.13"


MICRO_DRAFT = dict(hidden_size=64, target_hidden_size=64, intermediate_size=128, head_dim=16, vocab_size=512,
                   draft_vocab_size=64, torch_dtype="float32", max_position_embeddings=512)


AUX_LAYERS = [0, 1, 2]


NEWLINE = 204  # the micro target's "\n": its greedy continuations repeat it, so a draft proposing it is often right


CONFIG = DraftConfig(
    hidden_size=64, target_hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512, vocab_size=512,
    draft_vocab_size=128, torch_dtype="float32", aux_layers=AUX_LAYERS, target_num_hidden_layers=4,
    target_family="llama",
)


def tiny_draft(vocab=16, seed=0, draft_vocab=None):
    config = DraftConfig(hidden_size=32, target_hidden_size=32, intermediate_size=64, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
                         max_position_embeddings=64, vocab_size=vocab, draft_vocab_size=draft_vocab or vocab,
                         torch_dtype="float32",
                         aux_layers=[0, 1, 2], target_num_hidden_layers=4)
    model = Eagle3Draft(config, torch.randn(vocab, 32, generator=torch.Generator().manual_seed(seed)))
    init_weights(model, seed)
    return model  # d2t all zero: draft row i predicts target id i


def greedy_reply(model, prompt: list[int], max_new_tokens: int, eos: int) -> list[int]:
    """The target's greedy reply: its continuation up to EOS (kept) or max_new_tokens."""
    continuation = target_greedy(model, prompt, max_new_tokens)
    return continuation[: continuation.index(eos) + 1] if eos in continuation else continuation


def random_draft(micro, seed: int = 1, config: DraftConfig = CONFIG) -> Eagle3Draft:
    """Llama init scaled to std 0.1, so that every part of the network moves the drafts."""
    model = Eagle3Draft(config, micro["embed"])
    init_weights(model, seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith("norm.weight") and not name.startswith("embed_tokens"):
                param.mul_(5.0)
        model.d2t.copy_(micro["vocab_map"].d2t)
        model.t2d.copy_(micro["vocab_map"].t2d)
    return model.eval()


def lens_draft(micro, config: DraftConfig = CONFIG) -> Eagle3Draft:
    """A draft that reads the target: fc passes the output of layer 2 through, attention and MLP add
    nothing, and norm + lm_head are the target's (its rows for the draft vocabulary). At index t it
    predicts the target's guess for x_{t+1} from one layer early, so it depends on the features and is
    right on repeats; features shifted by one position would make it right far more often."""
    model = random_draft(micro, config=config)
    head = target_head(micro["path"])
    hidden = config.hidden_size
    with torch.no_grad():
        model.fc.weight.zero_()
        model.fc.weight[:, 2 * hidden :] = torch.eye(hidden)  # aux = cat(layer 0, layer 1, layer 2)
        model.midlayer.self_attn.o_proj.weight.zero_()
        model.midlayer.mlp.down_proj.weight.zero_()
        model.norm.weight.copy_(head["norm"])
        model.lm_head.weight.copy_(head["lm_head"][model.hot_token_ids()])
    return model


def rewrite(src, dst, edit):
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    save_file(edit(tensors), dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def edit_tensors(path, mutate):
    tensors = load_file(path / "model.safetensors")
    mutate(tensors)
    save_file(tensors, path / "model.safetensors")


def codes(report, severity="error"):
    return {p.code for p in report.of(severity)}


# ---- Serving and benchmarking the micro target

STEPS, MAX_NEW = 3, 24  # the reference-server tests' drafting steps and reply length


@contextlib.contextmanager
def serving(*args, **kwargs):
    """create_app(*args, **kwargs) served on a free port; yields an httpx client."""
    with serve_in_thread(create_app(*args, **kwargs)) as (url, _):
        with httpx.Client(base_url=url, timeout=120) as client:
            yield client


def generate(client, max_new_tokens=MAX_NEW, **body) -> dict:
    body = {**body, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def requests(micro):
    """The rendered pydoc prompts as ids, and two plain texts (one continues with a token outside the draft vocab)."""
    return [{"input_ids": p} for p in micro["prompts"]] + [{"text": "import os\n"}, {"text": "The"}]


def prompt_of(micro, request) -> list[int]:
    if "input_ids" in request:
        return request["input_ids"]
    return load_tokenizer(str(micro["path"]))(request["text"])["input_ids"]  # the tokenizer's defaults, as SGLang


def store_requests(config, micro):
    """What the data stage leaves for the benchmark: its requests with the micro target's greedy continuations."""
    regen = config.stage_dir("data") / REGEN_DIR
    regen.mkdir(parents=True, exist_ok=True)

    class Greedy:
        def continue_greedy(self, prompts, length):
            return [target_greedy(micro["model"], p, length) for p in prompts]

    continue_every_suite(config, Greedy(), load_tokenizer(str(micro["path"])))


def continue_every_suite(config, generator, tokenizer) -> None:
    """The greedy continuations the data stage makes: the held-out suite's with the training replies, the other
    suites' in the suites stage's output."""
    spec = continuing(config)
    continue_heldout(spec, generator, tokenizer, config.stage_dir("data") / REGEN_DIR / GREEDY_FILE, lambda line: None)
    suites_dir(config.run).mkdir(parents=True, exist_ok=True)
    continue_benchmark(spec, benchmark_questions(spec, held_out=False), generator, tokenizer,
                       suites_dir(config.run) / GREEDY_FILE, lambda line: None)


HELDOUT = ["Explain what a Python list comprehension is.", "What does the len() function return?"]


def write_heldout(config) -> None:
    """What the data stage leaves for the benchmark: the held-out prompts and their requests, continued greedily by the
    configured target."""
    heldout = config.stage_dir("data") / HELDOUT_FILE
    heldout.parent.mkdir(parents=True)
    heldout.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}]}) + "\n" for q in HELDOUT))
    (config.stage_dir("data") / REGEN_DIR).mkdir()
    continue_every_suite(config, make_generator(config.data, config.target, config.training.seed),
                         load_tokenizer(config.target))


# ---- Registry versions and run directories

PREFIX = "drafts"


def write_checkpoint(path: Path, seed: int) -> Path:
    """A checkpoint-like directory: a config, two weight-sized random files, one in a subdirectory."""
    rng = random.Random(seed)
    (path / "shards").mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"], "seed": seed}))
    (path / "model.safetensors").write_bytes(rng.randbytes(50_000))
    (path / "shards" / "extra.bin").write_bytes(rng.randbytes(3_000))
    return path


def fields(accept_length: float = 2.4, accept_rate: float = 0.47, simulated: float = 2.5, parent: str | None = None) -> dict:
    return {
        "config_hash": "c0ffee", "data_hash": "da7a", "vocab_hash": "70c4b", "code_version": "0.1.0+test",
        "lineage": {"parent": parent, "run": "run-1"},
        "metrics": {
            "served": {"accept_length": accept_length, "accept_rate": accept_rate, "histogram": [3, 5, 8, 4],
                       "output_tokens_per_s": 812.5, "lost_requests": 0, "server_version": "0.5.13"},
            "simulated": {"accept_length": simulated},
            "engine_release": "0.5.13",
        },
    }


DAY = 86400


def make_run(base, day: int, registry, size: int = 1000):
    """A retrain run made `day` days after 2024-01-01 for `registry` (None: no resolved config), with a `size`-byte
    shard."""
    run = retrain_dir(base, when=1704067200 + day * DAY)
    (run / "data").mkdir(parents=True)
    (run / "data" / "shard.bin").write_bytes(b"x" * size)
    if registry is not None:
        (run / RESOLVED_FILE).write_text(yaml.safe_dump({"registry": {"backend": "local", "path": str(registry)}}))
    return run


# ---- Production's monitor

BASELINE = 3.0  # the production version's served accept length at its promotion


class ProductionEdge:
    """The edge of a production server: /health, and /metrics with the two counters the monitor reads."""

    def __init__(self):
        self.tokens, self.verify_calls = 0.0, 0.0
        self.app = FastAPI()
        self.app.get("/health")(lambda: {})
        self.app.get("/metrics", response_class=PlainTextResponse)(self.metrics)

    def metrics(self) -> str:
        labels = '{model_name="kimi",engine_type="unified"}'
        return (f"# TYPE sglang:generation_tokens_total counter\nsglang:generation_tokens_total{labels} {self.tokens}\n"
                f"# TYPE sglang:spec_verify_calls_total counter\nsglang:spec_verify_calls_total{labels} "
                f"{self.verify_calls}\nsglang:spec_accept_length{labels} 2.5\n")


def write_record(directory: Path, sent: float, completion: int, verify: int, labels: dict | None = None) -> None:
    """One finished request, as SGLang's exporter writes it (hourly files named in local time)."""
    name = f"sglang-request-metrics-{datetime.fromtimestamp(sent).strftime('%Y%m%d_%H')}.log"
    parameters = {"text": "def f(x):", "sampling_params": {"max_new_tokens": 256}, "custom_labels": labels}
    record = {"request_parameters": json.dumps(parameters), "prompt_tokens": 12, "completion_tokens": completion,
              "spec_verify_ct": verify, "spec_accept_length": completion / verify, "response_sent_to_client_ts": sent}
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / name, "a") as f:
        f.write(json.dumps(record) + "\n")


def monitor_overrides(tmp_path, port: int, *overrides: str) -> list[str]:
    return [f"registry.path={tmp_path / 'registry'}", f"production.port={port}",
            f"production.telemetry.records_dir={tmp_path / 'records'}", "monitor.window_s=600",
            "monitor.min_verify_steps=100", "monitor.consecutive=3", "monitor.cooldown_s=3600", *overrides]


def monitor_for(registry_section, tmp_path, port: int, *overrides: str) -> Monitor:
    """A registry whose production version recorded BASELINE, watched on production.port."""
    config = load_config(TINY, monitor_overrides(tmp_path, port, *overrides))
    registry = open_registry(registry_section or config.registry, log=lambda line: None)
    manifest = fields(accept_length=BASELINE)
    manifest["metrics"]["production"] = {"accept_length": BASELINE, "output_tokens_per_s": 900.0,
                                         "baseline_output_tokens_per_s": 400.0, "speedup": 2.25}
    registry.publish("v1", {"sglang": write_checkpoint(tmp_path / "v1", 1)}, manifest)
    registry.promote("v1", None, ["first"], by="test")
    return Monitor(config.monitor, config.production, config.serving, registry, log=lambda line: None)


def traffic(tmp_path, start: float, accept: float, steps: int = 200) -> None:
    """Users' requests in [start, start + 600 s) with the given accept length, `steps` verify steps in all."""
    for i in range(4):
        write_record(tmp_path / "records", start + 60 + 120 * i, int(accept * steps / 4), steps // 4, {"app": "code"})


# ---- Processes a test starts

SERVER_START_S = 120  # a fresh database is migrated first


def tail(path: Path, lines: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(no log)"


def wait_for(condition, timeout_s: float, what: str, log: Path) -> float:
    """Seconds until `condition()`; fails with the log's tail after `timeout_s`."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout_s:
            pytest.fail(f"no {what} within {timeout_s:.0f} s:\n{tail(log)}")
        time.sleep(0.2)
    return time.monotonic() - start


class Processes:
    """Background processes, each in its own process group; `stop()` ends the groups and then every process that
    carries this test's marker in its environment (the flow run's process starts its own session, and so do the
    servers and trainers it launches), so nothing outlives the test."""

    def __init__(self, env: dict[str, str], marker: tuple[str, str], logs: Path) -> None:
        self.env, self.marker, self.logs = env, marker, logs
        self.started: list[subprocess.Popen] = []

    def start(self, name: str, command: list[str], cwd: Path) -> tuple[subprocess.Popen, Path]:
        log = self.logs / f"{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(command, cwd=cwd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        self.started.append(proc)
        return proc, log

    def stop(self) -> list[str]:
        for proc in reversed(self.started):
            stop_group(proc.pid, lambda proc=proc: proc.poll() is not None)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        return self.sweep()

    def marked(self) -> list[tuple[int, str]]:
        """(pid, command) of every live process carrying this test's marker (a zombie's environment reads empty)."""
        needle = f"{self.marker[0]}={self.marker[1]}".encode()
        found = []
        for entry in Path("/proc").glob("[0-9]*"):
            pid = int(entry.name)
            if pid == os.getpid():
                continue
            try:
                if needle not in (entry / "environ").read_bytes().split(b"\0"):
                    continue
                found.append((pid, (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")))
            except OSError:
                continue
        return found

    def sweep(self) -> list[str]:
        killed = []
        for pid, command in self.marked():
            try:
                pgid = os.getpgid(pid)
            except ProcessLookupError:
                continue
            killed.append(f"{pid}: {command[:160]}")
            if pgid == os.getpgrp():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            else:
                stop_group(pgid, lambda pid=pid: not Path(f"/proc/{pid}").exists(), grace_s=3)
        return killed


def stop_group(pgid: int, gone, grace_s: float = 10.0) -> None:
    """SIGTERM to the group, SIGKILL to whatever is left after `grace_s`."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and not gone():
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def wait_healthy(base: str, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"prefect server start exited {server.returncode}:\n{tail(log)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/api/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    pytest.fail(f"no /api/health from the Prefect server within {SERVER_START_S} s:\n{tail(log)}")


# ---- A stage a test adds to the table

def write_seed(run: StageRun) -> None:
    out = output_of(run.config, "toy")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"{run.config.training.seed} {run.config.vocab.draft_vocab_size}\n")
    run.log(f"toy: wrote {out}")


# a stage a test adds to eagle3.stages.table.STAGES: one entry and its runner
TOY = Stage("toy", "toy/seed.txt", key=("training.seed",), runner=write_seed, command=("toy",),
            help="a toy stage: the seed and the draft vocabulary's size", upstream={"vocab": "vocab"})


def micro_of(micro_target: Path) -> dict:
    """The target, three rendered pydoc prompts (one continues with newlines only), and a vocab map
    counted over their greedy continuations (ids below 256, so that absolute ids + arange stay in range)."""
    model = AutoModelForCausalLM.from_pretrained(micro_target, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(str(micro_target))
    turns = [t for i, t in enumerate(itertools.islice(pydoc_prompt_turns(), 60)) if i in (0, 20, 50)]
    prompts = [prompt_ids(tokenizer, messages, False) for messages in turns]
    eos = model.generation_config.eos_token_id
    seqs = [p + greedy_reply(model, p, 24, eos) for p in prompts]
    counts = torch.bincount(torch.tensor(sum(seqs, [])), minlength=512)
    counts[256:] = 0
    vocab_map, _ = build_vocab_map(counts, CONFIG.draft_vocab_size)
    embed = target_head(micro_target)["embed"]
    return dict(model=model, prompts=prompts, seqs=seqs, eos=eos, vocab_map=vocab_map, embed=embed,
                turns=turns, path=micro_target)


def block_export(kind: str, model, write_sglang, tmp_path: Path) -> tuple[Path, Path]:
    """A DFlash-backbone draft (`kind`'s `model`) written as training writes it and exported by `write_sglang` under
    tmp_path, and the manifest of a data set captured at its layers on a llama target."""
    from eagle3.algorithms import algorithm
    from eagle3.records.manifest import write_manifest

    native = tmp_path / "native"
    native.mkdir()
    algorithm(kind).write_draft(model.config, model.export_state(), native, {})
    data = tmp_path / "data"
    data.mkdir()
    write_manifest(data, kind="dataset", fields={"capture": {"aux_layers": model.config.aux_layers},
                                                 "target": {"family": "llama"}})
    return write_sglang(native, tmp_path / "sglang"), data / "manifest.json"


def rewritten(directory: Path, change) -> Path:
    """The export at `directory` with its config.json changed in place by `change(raw)`."""
    raw = json.loads((directory / "config.json").read_text())
    change(raw)
    (directory / "config.json").write_text(json.dumps(raw))
    return directory
