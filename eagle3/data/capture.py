"""Hidden-state capture: the target's aux hidden states (and its last hidden state) for every
regenerated sample, stored as bf16 shards under `run.dir/data/hidden/`.

Convention (DESIGN §3): aux layer k is the output of decoder layer k, i.e. HF hidden_states[k + 1].
The last hidden state is the input (`pre_norm`) or the output (`post_norm`, the default) of the
target's final norm; `post_norm` is what the target's lm_head reads, so target logits are
lm_head(last_hidden) directly. The manifest records which one was stored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from eagle3.config import PipelineConfig
from eagle3.data.conversation import chat_template_hash
from eagle3.data.regenerate import REGEN_DIR, read_regenerated
from eagle3.data.shards import (
    KINDS,
    CapturedSample,
    partial_file,
    read_partial,
    read_stamp,
    shard_file,
    write_partial,
    write_shard,
)
from eagle3.data.targets import check_same, load_tokenizer, target_identity
from eagle3.errors import Eagle3Error, UnreadableInput
from eagle3.engines.sglang_capture import run_on_node
from eagle3.formats.manifest import code_version, read_manifest, write_manifest
from eagle3.data.storage import check_storage, projected_bytes
from eagle3.progress import Progress

Log = Callable[[str], None]
HIDDEN_DIR = "hidden"


class LocalCapture:
    """A capture pass with transformers; hooks on the final norm give its input and output.

    `kinds` selects what the pass returns; the local engine can return both in one pass."""

    release = None

    def __init__(self, model_path: str, aux_layers: list[int], last_hidden: str, kinds: tuple[str, ...] = KINDS):
        self.model_path, self.aux_layers, self.last_hidden, self.kinds = model_path, aux_layers, last_hidden, kinds
        self._norm_io: dict[str, torch.Tensor] = {}

    def start(self, log: Log) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32).eval()
        self.model.model.norm.register_forward_hook(self._record_norm)

    def stop(self) -> None:
        del self.model

    def _record_norm(self, module, inputs, output) -> None:
        self._norm_io["pre_norm"], self._norm_io["post_norm"] = inputs[0], output

    @torch.no_grad()
    def states(self, sequences: list[list[int]]) -> list[dict[str, torch.Tensor]]:
        """Per sequence: {"aux_hidden": [T, n_aux * H], "last_hidden": [T, H]} (the kinds asked for).
        Right padding: causal attention keeps every real position independent of the padding after it."""
        width = max(map(len, sequences))
        ids = torch.zeros(len(sequences), width, dtype=torch.long)  # [B, T]
        attention = torch.zeros_like(ids)
        for row, seq in enumerate(sequences):
            ids[row, : len(seq)] = torch.tensor(seq)
            attention[row, : len(seq)] = 1
        out = self.model(input_ids=ids, attention_mask=attention, output_hidden_states=True)
        batch = {}
        if "aux_hidden" in self.kinds:
            batch["aux_hidden"] = torch.cat([out.hidden_states[k + 1] for k in self.aux_layers], dim=-1)  # [B, T, n_aux * H]
        if "last_hidden" in self.kinds:
            batch["last_hidden"] = self._norm_io[self.last_hidden]  # [B, T, H]
        return [{kind: batch[kind][row, : len(seq)] for kind in self.kinds} for row, seq in enumerate(sequences)]


def regenerated_manifest(config: PipelineConfig) -> dict:
    """The regeneration manifest, refused when it was made for another target, tokenizer or template."""
    regen = config.stage_dir("data") / REGEN_DIR
    try:
        manifest = read_manifest(regen)
    except FileNotFoundError:
        raise UnreadableInput(f"{regen}: no finished regeneration here; run `eagle3 data regenerate` first") from None
    expected = target_identity(config.target)
    check_same(f"regenerated data in {regen}", manifest["target"], expected, ("path", "config_sha256", "tokenizer_sha256", "family"))
    tokenizer = load_tokenizer(config.target.path)
    check_same(
        f"regenerated data in {regen}",
        manifest,
        {"chat_template_sha256": chat_template_hash(tokenizer), "thinking": config.data.thinking},
        ("chat_template_sha256", "thinking"),
    )
    return manifest


def capture(config: PipelineConfig, log: Log = print, passes: list | None = None) -> Path:
    """Capture hidden states for every regenerated sample; returns the dataset directory.

    Work runs as passes, each started, run over the unfinished shards and stopped before the next one
    (on the GPU node two SGLang engines cannot share the GPUs). A pass that returns every kind writes
    final shards; otherwise each kind goes to a partial file, merged once all passes are done. Every
    file is stamped with its sample ids and the capture settings: on a re-run, a file is reused only
    when its stamp matches what would be computed now.
    """
    regen_manifest = regenerated_manifest(config)
    records = sorted(read_regenerated(config.stage_dir("data") / REGEN_DIR), key=lambda r: r["id"])
    out = config.stage_dir("data") / HIDDEN_DIR
    per_shard = config.data.shard_samples
    shards = [records[i : i + per_shard] for i in range(0, len(records), per_shard)]
    settings = capture_settings(config)
    stamps = [{"sample_ids": [r["id"] for r in shard], **settings} for shard in shards]
    pending = [k for k in range(len(shards)) if not is_current(shard_file(out, k), stamps[k])]
    check_storage(config, sum(len(r["input_ids"]) for k in pending for r in shards[k]), out, log)
    out.mkdir(parents=True, exist_ok=True)
    passes = passes or [LocalCapture(config.target.path, config.data.aux_layers, config.data.last_hidden)]
    for capture_pass in passes:
        todo = [k for k in pending if not all(is_current(partial_file(out, k, kind), stamps[k]) for kind in capture_pass.kinds)]
        if todo:
            run_pass(capture_pass, [(k, shards[k], stamps[k]) for k in todo], out, config.data.batch_size, log)
    for k in pending:
        if not is_current(shard_file(out, k), stamps[k]):
            merge_partials(out, k, shards[k], stamps[k])
    for stale in out.glob("shard-*.safetensors"):
        if int(stale.name[len("shard-") :][:5]) >= len(shards):
            stale.unlink()  # left by an earlier, larger capture into the same directory
    release = next((p.release for p in passes if p.release), None) or recorded_release(out, len(shards))
    write_manifest(out, kind="dataset", fields=dataset_fields(config, regen_manifest, release, records))
    log(f"capture: {len(records)} samples in {len(shards)} shard(s) at {out} ({len(shards) - len(pending)} reused)")
    return out


def capture_with_engine(config: PipelineConfig, config_path: str | Path, overrides: list[str], log: Log = print) -> Path:
    """Capture with `data.capture_engine`: here (transformers), or SGLang on the GPU node - a subprocess in the
    node's SGLang environment that reads the same config file and overrides. Returns the dataset directory."""
    if config.data.capture_engine == "sglang":
        run_on_node(config, str(config_path), overrides, log=log)
        return config.stage_dir("data") / HIDDEN_DIR
    return capture(config, log=log)


def capture_settings(config: PipelineConfig) -> dict:
    """What the stored rows depend on besides the samples themselves."""
    return {
        "target": target_identity(config.target),
        "aux_layers": list(config.data.aux_layers),
        "last_hidden": config.data.last_hidden,
        "engine": config.data.capture_engine,
    }


def is_current(path: Path, stamp: dict) -> bool:
    if not path.exists():
        return False
    recorded = read_stamp(path)
    return recorded is not None and {k: v for k, v in recorded.items() if k != "engine_release"} == stamp


def recorded_release(out: Path, count: int) -> str | None:
    """The engine release stamped on the shards, when every pass was resumed (none started now)."""
    releases = {(read_stamp(shard_file(out, k)) or {}).get("engine_release") for k in range(count)}
    return releases.pop() if len(releases) == 1 else None


def run_pass(capture_pass, shards: list[tuple[int, list[dict], dict]], out: Path, batch_size: int, log: Log) -> None:
    name = "+".join(capture_pass.kinds)
    progress = Progress(f"capture ({name})", total=sum(len(s) for _, s, _ in shards), unit="samples", log=log)
    capture_pass.start(log)
    try:
        for index, shard, stamp in shards:
            states = []
            for start in range(0, len(shard), batch_size):
                batch = shard[start : start + batch_size]
                states += capture_pass.states([r["input_ids"] for r in batch])
                progress.advance(len(batch), tokens=sum(len(r["input_ids"]) for r in batch))
            check_rows(shard, states)
            stamped = {**stamp, "engine_release": capture_pass.release}
            if set(capture_pass.kinds) == set(KINDS):
                write_shard(shard_file(out, index), [captured(r, s) for r, s in zip(shard, states)], stamped)
            else:
                for kind in capture_pass.kinds:
                    write_partial(partial_file(out, index, kind), [s[kind] for s in states], stamped)
    finally:
        capture_pass.stop()


def check_rows(shard: list[dict], states: list[dict[str, torch.Tensor]]) -> None:
    """Every kind must have one row per token: an engine that drops rows (prefix cache hits, chunked
    prefill) would misalign every later position."""
    for record, state in zip(shard, states):
        for kind, tensor in state.items():
            if tensor.shape[0] != len(record["input_ids"]):
                raise Eagle3Error(
                    f"sample {record['id']}: the engine returned {tensor.shape[0]} rows of {kind} for "
                    f"{len(record['input_ids'])} tokens"
                )


def captured(record: dict, state: dict[str, torch.Tensor]) -> CapturedSample:
    return CapturedSample(
        record["id"], torch.tensor(record["input_ids"]), torch.tensor(record["loss_mask"]), state["aux_hidden"], state["last_hidden"]
    )


def merge_partials(out: Path, index: int, shard: list[dict], stamp: dict) -> None:
    parts = {kind: read_partial(partial_file(out, index, kind)) for kind in KINDS}
    states = [{kind: parts[kind][i] for kind in KINDS} for i in range(len(shard))]
    check_rows(shard, states)
    release = (read_stamp(partial_file(out, index, KINDS[0])) or {}).get("engine_release")
    write_shard(shard_file(out, index), [captured(r, s) for r, s in zip(shard, states)], {**stamp, "engine_release": release})
    for kind in KINDS:
        partial_file(out, index, kind).unlink()


def dataset_fields(config: PipelineConfig, regen_manifest: dict, release: str | None, records: list[dict]) -> dict:
    per_token, total = projected_bytes(config, sum(len(r["input_ids"]) for r in records))
    return {
        "target": regen_manifest["target"],
        "chat_template_sha256": regen_manifest["chat_template_sha256"],
        "thinking": regen_manifest["thinking"],
        "regeneration": {
            key: regen_manifest[key] for key in ("engine", "engine_release", "source", "sampling", "max_length")
        },
        "capture": {
            "aux_layers": list(config.data.aux_layers),
            "last_hidden": config.data.last_hidden,
            "dtype": "bfloat16",
            "engine": config.data.capture_engine,
            "engine_release": release,
        },
        "samples": len(records),
        "tokens": sum(len(r["input_ids"]) for r in records),
        "loss_tokens": sum(sum(r["loss_mask"]) for r in records),
        "bytes_per_token": per_token,
        "bytes": total,
        "code_version": code_version(),
    }


def check_dataset(config: PipelineConfig, manifest: dict) -> None:
    """Refuse a dataset made for another target, other layers or another template than the config's."""
    where = f"the dataset in {config.stage_dir('data') / HIDDEN_DIR}"
    check_same(where, manifest["target"], target_identity(config.target), ("path", "config_sha256", "tokenizer_sha256", "family"))
    check_same(where, manifest["capture"], {"aux_layers": list(config.data.aux_layers), "last_hidden": config.data.last_hidden},
               ("aux_layers", "last_hidden"))
    check_same(where, manifest, {"thinking": config.data.thinking}, ("thinking",))
