"""GPU smoke test of ONLINE training at a realistic shape (not CI): a random-init DeepSeek-V3-style target
(MLA attention, MoE layers, Kimi's 163,840-id vocabulary, ~0.5 B parameters) feeds the trainer its features
batch by batch through the transformers backend, and the trainer's own step trains an EAGLE-3 draft on a few
fixed random-token sequences. Nothing is downloaded and SGLang is not needed.

Checks, each named when it fails (exit code 1):
  loss-falls   the loss over the last steps is below LOSS_RATIO x the loss over the first steps
  no-d2h       under torch.profiler no device-to-host copy is as large as one token row of features x the batch
               (features must stay on the device); skipped on the CPU, where there is no device
A crash before the checks complete prints its traceback and exits 2.
Figures: tokens/s of the online step (target forward + draft step) and of the target forward alone, peak GPU
memory, the loss curve.

The GPU image's python3 has torch and transformers but not pydantic (eagle3's configs): carry the wheels of
pydantic, pydantic-core, annotated-types, typing-inspection and typing-extensions and install them first.

    PYTHONPATH=. python3 infra/gpu-smoke/online_train.py              # H200: ~0.5 B target, 4 x 512 tokens, 300 steps
    PYTHONPATH=. .venv/bin/python infra/gpu-smoke/online_train.py --tiny --steps 40   # CPU check of the script
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from eagle3.config import PipelineConfig
from eagle3.distributed import Dist
from eagle3.runtime.features import FeatureBackend, TokenBatch, TransformersFeatures
from eagle3.target.info import read_target_info
from eagle3.draft.vocab_map import VocabMap, build_vocab_map
from eagle3.model.teacher import TEACHER_CHUNK_ROWS, chunked_argmax
from eagle3.algorithms.eagle3.ttt import TTTModel
from eagle3.model.weights import target_head
from eagle3.train.data import SampleRef
from eagle3.train.parallel import Parallel
from eagle3.train.schedule import optimizer_and_schedule
from eagle3.train.trainer import Trainer

# A random-init head gives logits of std ~0.02 * sqrt(H): a nearly flat next-token distribution whose entropy is
# close to ln(draft vocab), so the soft cross-entropy could hardly fall whatever the trainer did. A trained target's
# head is peaked; rows of std HEAD_LOGIT_STD / sqrt(H) give logits of std ~HEAD_LOGIT_STD (the final norm makes
# the hidden state's rms 1), a peaked teacher the draft can learn.
HEAD_LOGIT_STD = 4.0
LOSS_WINDOW = 20  # steps averaged at each end of the loss curve
LOSS_RATIO = 0.7  # the last window's mean loss must be below this share of the first window's
WARMUP_TIMED = 5  # steps before the throughput clock starts (kernel selection, AdamW state)
PROFILED_STEPS = 3
TIMED_FORWARDS = 10


class SmokeFailure(Exception):
    def __init__(self, check: str, message: str):
        super().__init__(f"check {check} FAILED: {message}")


@dataclass(frozen=True)
class Shape:
    # target (transformers DeepseekV3Config fields)
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # the dense layers' MLP
    moe_intermediate_size: int
    num_hidden_layers: int
    first_k_dense_replace: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # draft and training
    aux_layers: tuple[int, ...]
    draft_heads: int
    draft_kv_heads: int
    draft_intermediate: int
    draft_vocab_size: int
    ttt_steps: int
    batch: int
    seq_len: int
    learning_rate: float
    warmup_steps: int


# ~0.51 B parameters: embedding and head 2 x 163,840 x 1,024 = 336 M, 1 dense + 7 MoE layers (16 experts, 4 active,
# one shared) 172 M. Aux layers [1, 3, 4]: SGLang's default for 8 layers. The draft is Kimi's shape scaled to
# H 1,024 (head_dim 64, GQA 4:1, intermediate ~2.6 H, 32,000 draft ids, TTT 7).
FULL = Shape(
    vocab_size=163840, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=384, num_hidden_layers=8,
    first_k_dense_replace=1, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
    num_attention_heads=16, q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
    aux_layers=(1, 3, 4), draft_heads=16, draft_kv_heads=4, draft_intermediate=2816, draft_vocab_size=32000,
    ttt_steps=7, batch=4, seq_len=512, learning_rate=1e-3, warmup_steps=20,
)
# The same architecture at H 64 with a 32,768-id vocabulary (2,048 draft ids): vocabulary-sized matmuls dominate a
# CPU step, and this runs 40 steps in under a minute on two cores.
TINY = Shape(
    vocab_size=32768, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
    first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
    num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    aux_layers=(0, 1, 2), draft_heads=4, draft_kv_heads=2, draft_intermediate=128, draft_vocab_size=2048,
    ttt_steps=4, batch=2, seq_len=128, learning_rate=3e-3, warmup_steps=5,
)


# -- the target ----------------------------------------------------------------------------------------------


def target_config(shape: Shape) -> DeepseekV3Config:
    return DeepseekV3Config(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        moe_intermediate_size=shape.moe_intermediate_size, num_hidden_layers=shape.num_hidden_layers,
        first_k_dense_replace=shape.first_k_dense_replace, n_routed_experts=shape.n_routed_experts,
        n_shared_experts=1, num_experts_per_tok=shape.num_experts_per_tok, n_group=shape.n_group,
        topk_group=shape.topk_group, num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_attention_heads, q_lora_rank=shape.q_lora_rank,
        kv_lora_rank=shape.kv_lora_rank, qk_nope_head_dim=shape.qk_nope_head_dim,
        qk_rope_head_dim=shape.qk_rope_head_dim, v_head_dim=shape.v_head_dim, max_position_embeddings=4096,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
    )


def build_target(shape: Shape, out_dir: Path, device: torch.device, seed: int) -> int:
    """A random-init target saved in bf16 (HF layout: config.json + safetensors); returns its parameter count.
    Made on `device`: initialising 0.5 B parameters is quicker on a GPU."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = DeepseekV3ForCausalLM(target_config(shape))
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, HEAD_LOGIT_STD / math.sqrt(shape.hidden_size))  # see HEAD_LOGIT_STD
    params = sum(p.numel() for p in model.parameters())
    model.to(torch.bfloat16).save_pretrained(out_dir)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the backend loads its own copy, as the trainer's does
    return params


def fixed_sequences(shape: Shape, seed: int) -> torch.Tensor:
    """[B, T] int64 random target ids, the same every run (a CPU generator)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, shape.vocab_size, (shape.batch, shape.seq_len), generator=generator)


def vocab_map_from_teacher(backend: FeatureBackend, batch: TokenBatch, lm_head: torch.Tensor, size: int) -> VocabMap:
    """The draft vocabulary from the target's own greedy tokens on the sequences, as `eagle3 vocab build` counts
    the target's generated tokens: the teacher's argmax then falls inside the draft vocabulary."""
    last = backend.features(batch).last  # [B, T, H] on the device
    head = lm_head.to(last.device, last.dtype)  # [V, H]
    argmax = chunked_argmax(last, head, TEACHER_CHUNK_ROWS)  # [B, T]
    counts = torch.bincount(argmax.flatten().cpu(), minlength=lm_head.shape[0])  # [V]
    vocab_map, _ = build_vocab_map(counts, size)
    return vocab_map


# -- the trainer, fed fixed sequences ------------------------------------------------------------------------


def pipeline_config(shape: Shape, target_dir: Path, run_dir: Path, steps: int) -> PipelineConfig:
    """The config the trainer's methods read. run/data/serving/benchmark/registry values other than the aux layers
    and the last hidden state are required by the schema and unused here."""
    return PipelineConfig.model_validate({
        "run": {"name": "gpu-smoke-online", "dir": str(run_dir)},
        "target": {"path": str(target_dir), "family": "deepseek_v2", "num_hidden_layers": shape.num_hidden_layers,
                   "hidden_size": shape.hidden_size, "vocab_size": shape.vocab_size},
        "data": {"prompts": "builtin:pydoc", "num_samples": 1, "max_new_tokens": 1, "max_length": shape.seq_len,
                 "aux_layers": list(shape.aux_layers), "last_hidden": "post_norm", "feature_backend": "local"},
        "vocab": {"draft_vocab_size": shape.draft_vocab_size},
        "draft": {"intermediate_size": shape.draft_intermediate, "num_attention_heads": shape.draft_heads,
                  "num_key_value_heads": shape.draft_kv_heads, "max_position_embeddings": 4096,
                  "torch_dtype": "bfloat16"},
        "training": {"features": "online", "ttt_steps": shape.ttt_steps, "learning_rate": shape.learning_rate,
                     "warmup_steps": shape.warmup_steps, "max_steps": steps, "batch_size": shape.batch,
                     "seq_len": shape.seq_len, "grad_clip": 1.0, "seed": 0},
        "serving": {"context_length": 4096},
        "benchmark": {"max_new_tokens": 1, "num_prompts": 1},
        "registry": {"path": str(run_dir / "registry")},
    })


class FixedData:
    """Stands in for TrainingData: the same rows every step, every position in the loss."""

    def __init__(self, ids: torch.Tensor):
        self.ids = ids  # [B, T] int64, CPU
        self.refs = [SampleRef(shard=0, index=i, length=ids.shape[1], id=f"fixed-{i}") for i in range(ids.shape[0])]

    def tokens(self, refs: list[SampleRef]) -> tuple[TokenBatch, torch.Tensor]:
        rows = torch.tensor([ref.index for ref in refs])
        ids = self.ids[rows]  # [B, T]
        lengths = torch.full((len(refs),), ids.shape[1], dtype=torch.long)
        return TokenBatch(ids, lengths, [ref.id for ref in refs]), torch.ones_like(ids)  # loss mask [B, T]


class SmokeTrainer(Trainer):
    """The trainer with its data set, held-out samples and checkpoints left out: its __init__ needs a captured
    data set on disk, so this one sets the same attributes the same way. The step (`train_step`, `step_stats`,
    `step_metrics`), the draft (`build_model`) and the teacher (`build_teacher`) are the trainer's own."""

    def __init__(self, config: PipelineConfig, data: FixedData, features: FeatureBackend, vocab_map: VocabMap,
                 device: torch.device):
        self.config = config
        self.dist = Dist(device=device)
        self.log = print
        self.data = data
        self.features = features
        train = config.training
        self.per_forward = train.sequences_per_forward(self.dist.world)
        head = target_head(Path(config.target.path), config.target.weight_prefix)  # float32, CPU
        self.model = self.build_model(head, vocab_map)
        self.teacher = self.build_teacher(head, vocab_map)
        self.ttt = TTTModel(self.model, train.ttt_steps)
        self.parallel = Parallel(self.dist, train.fsdp)
        self.wrapped = self.parallel.wrap(self.ttt)
        self.step_weights = train.ttt_step_decay ** torch.arange(train.ttt_steps, dtype=torch.float32, device=device)
        self.optimizer, self.scheduler = optimizer_and_schedule(self.model, train)


# -- measuring -----------------------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(trainer: SmokeTrainer, steps: int) -> tuple[list[dict], float]:
    """`steps` optimizer steps on the fixed batch; returns each step's metrics and the tokens/s after warm-up.
    step_metrics' one device-to-host copy a step (as in the trainer's loop) keeps host and device in step."""
    refs, device = trainer.data.refs, trainer.dist.device
    curve, started, timed_tokens = [], None, 0
    for step in range(steps):
        if step == min(WARMUP_TIMED, steps - 1):
            synchronize(device)
            started, timed_tokens = time.perf_counter(), 0
        metrics = trainer.step_metrics(trainer.train_step(refs))
        timed_tokens += metrics["tokens"]
        curve.append(metrics)
        if step % 50 == 0 or step == steps - 1:
            print(f"  step {step + 1:4d}  loss {metrics['loss']:.4f}  step acc {metrics['step_acc']}")
    synchronize(device)
    return curve, timed_tokens / (time.perf_counter() - started)


def target_forward_rate(backend: FeatureBackend, batch: TokenBatch, device: torch.device) -> float:
    """Tokens/s of the feature backend alone (the target's forward and the hooks' concatenation)."""
    backend.features(batch)
    synchronize(device)
    started = time.perf_counter()
    for _ in range(TIMED_FORWARDS):
        backend.features(batch)
    synchronize(device)
    return TIMED_FORWARDS * batch.input_ids.numel() / (time.perf_counter() - started)


def profile_steps(trainer: SmokeTrainer, trace: Path) -> None:
    """PROFILED_STEPS training steps under torch.profiler (host and CUDA activity), written as a Chrome trace:
    its memcpy events carry byte counts, which the profiler's Python event list does not."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(PROFILED_STEPS):
            trainer.step_metrics(trainer.train_step(trainer.data.refs))
        synchronize(trainer.dist.device)
    profiler.export_chrome_trace(str(trace))


def device_to_host_copies(trace: Path) -> list[tuple[int, str]]:
    """(bytes, the op that launched it) of every device-to-host memcpy in a Chrome trace, largest first."""
    events = json.loads(trace.read_text()).get("traceEvents", [])
    ops = {e["args"]["External id"]: e["name"] for e in events
           if e.get("cat") == "cpu_op" and "External id" in e.get("args", {})}
    copies = []
    for event in events:
        if event.get("cat") == "gpu_memcpy" and "DtoH" in event.get("name", ""):
            args = event.get("args", {})
            copies.append((int(args.get("bytes", 0)), ops.get(args.get("External id"), "?")))
    return sorted(copies, reverse=True)


# -- checks --------------------------------------------------------------------------------------------------


def check_loss_falls(curve: list[dict]) -> None:
    """On fixed repeated sequences a working trainer drives the loss down towards the teacher's entropy; one that
    does not update the draft, or trains it against misaligned targets, leaves it near where it began."""
    window = max(1, min(LOSS_WINDOW, len(curve) // 4))
    losses = [m["loss"] for m in curve]
    first, last = sum(losses[:window]) / window, sum(losses[-window:]) / window
    print(f"loss: first {window} steps {first:.4f}, last {window} steps {last:.4f} (ratio {last / first:.3f}, "
          f"must be < {LOSS_RATIO}); min {min(losses):.4f}; last step acc {curve[-1]['step_acc']}")
    if not all(math.isfinite(x) for x in losses):
        raise SmokeFailure("loss-falls", "the loss is not finite")
    if not last < LOSS_RATIO * first:
        raise SmokeFailure("loss-falls", f"last-{window} mean {last:.4f} is not below {LOSS_RATIO} x first-{window} "
                                         f"mean {first:.4f}: the draft did not learn the fixed sequences")


def check_no_feature_copies(copies: list[tuple[int, str]], limit: int) -> None:
    print(f"device-to-host copies in {PROFILED_STEPS} profiled steps: {len(copies)}; largest (bytes, op): "
          f"{copies[:5]}; limit {limit:,} bytes (one token row of aux + last features x the batch, bf16)")
    if not copies:
        # step_metrics copies the step's sums to the host every step: seeing none means the tracer saw nothing.
        raise SmokeFailure("no-d2h", "the profiler recorded no device-to-host copy at all, not even the per-step "
                                     "metrics: CUDA activity tracing is not working, so the check cannot be made")
    big = [c for c in copies if c[0] >= limit]
    if big:
        raise SmokeFailure("no-d2h", f"{len(big)} device-to-host copies of >= {limit:,} bytes per "
                                     f"{PROFILED_STEPS} steps (features leaving the device?): {big[:5]}")


# -- main ----------------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> None:
    shape = TINY if args.tiny else FULL
    if args.lr is not None:
        shape = replace(shape, learning_rate=args.lr)
    # cuda:0, not "cuda": the trainer's collectives compare devices, and cuda:0 != cuda
    device = torch.device("cuda", 0) if torch.cuda.is_available() and not args.cpu else torch.device("cpu")
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory(prefix="eagle3-online-smoke-") as tmp:
        tmp = Path(tmp)
        target_dir = tmp / "target"
        started = time.perf_counter()
        params = build_target(shape, target_dir, device, args.seed)
        info = read_target_info(target_dir)  # what the pipeline reads of a target
        print(f"target: {params:,} parameters ({info.architecture}, family {info.family}, "
              f"{info.num_hidden_layers} layers, H {info.hidden_size}, vocab {info.vocab_size}), built and saved in "
              f"bf16 on {device} in {time.perf_counter() - started:.1f} s")

        config = pipeline_config(shape, target_dir, tmp / "run", args.steps)
        data = FixedData(fixed_sequences(shape, args.seed))
        batch, _ = data.tokens(data.refs)
        backend = TransformersFeatures(str(target_dir), list(shape.aux_layers), config.data.last_hidden, device)
        vocab_map = vocab_map_from_teacher(backend, batch, target_head(target_dir)["lm_head"], shape.draft_vocab_size)
        trainer = SmokeTrainer(config, data, backend, vocab_map, device)
        trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        print(f"draft: {trainable / 1e6:.1f} M trainable, aux layers {list(shape.aux_layers)}, TTT {shape.ttt_steps}; "
              f"batch {shape.batch} x {shape.seq_len} tokens, {args.steps} steps, lr {shape.learning_rate}")

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        curve, step_rate = train(trainer, args.steps)
        forward_rate = target_forward_rate(backend, batch, device)
        draft_rate = 1 / max(1 / step_rate - 1 / forward_rate, 1e-12)
        print(f"throughput: online step {step_rate:,.0f} tokens/s (target forward + draft step); target forward alone "
              f"{forward_rate:,.0f} tokens/s; draft step (the difference) ~{draft_rate:,.0f} tokens/s")
        if device.type == "cuda":
            print(f"peak GPU memory: {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB allocated "
                  f"(target, draft, AdamW state, one step's activations)")
        check_loss_falls(curve)

        if device.type != "cuda":
            print("no-d2h: SKIPPED on the CPU: there is no device, so no device-to-host copy to look for")
            return
        aux_width = len(shape.aux_layers) * shape.hidden_size
        limit = shape.batch * (aux_width + shape.hidden_size) * 2  # one token row of features x the batch, bf16
        profile_steps(trainer, tmp / "trace.json")
        check_no_feature_copies(device_to_host_copies(tmp / "trace.json"), limit)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="H 64 target and draft: a CPU check of this script")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=None, help="override the shape's learning rate (e.g. 1e-12: a "
                                                                 "draft that does not learn, to see loss-falls fail)")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU even where CUDA exists")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.steps < 2 * 4:
        parser.error("--steps must be at least 8 (the loss check compares the first and last quarter)")
    try:
        run(args)
    except SmokeFailure as failure:
        print(f"online_train: {failure}", file=sys.stderr)
        return 1
    except Exception:
        traceback.print_exc()
        print("online_train: FAILED: the run crashed (traceback above) before its checks completed", file=sys.stderr)
        return 2
    print("online_train: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
