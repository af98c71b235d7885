"""Smoke test of the `sglang` feature backend on a GPU node (not CI): SGLang's model runner inside every torchrun rank,
the target tensor-parallel over all of them, as the trainer builds it for online features.

    torchrun --nproc-per-node N infra/gpu-smoke/features_sglang.py --model PATH --family F --layers 1,29,57 \
        [--batches 4 --rows 4 --min-len 64 --max-len 512 --mem-fraction 0.6 --engine-arg trust_remote_code=true]
        [--compare-transformers]      (small targets only: transformers on rank 0's GPU, after SGLang is closed)

Run it with the python of the node's SGLang environment (SGLang 0.5.23 and this project, `pip install --no-deps -e .`).
Per batch it checks the shapes and finite values, that every rank got the same features (before any row slicing),
and once that `rows=` returns the same rows; it prints tokens/s and peak GPU memory per rank. Exit status 0: all held.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from eagle3.distributed import setup_distributed
from eagle3.runtime.features import Features, TokenBatch, TransformersFeatures
from eagle3.runtime.sglang_features import SGLangFeatures

RELATIVE_TOLERANCE = 0.05  # transformers vs SGLang in bf16 on a GPU: relative row error (as compare_capture.py)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--family", required=True, help="the target's SGLang model file, e.g. llama, kimi_k25")
    parser.add_argument("--layers", required=True, help="aux layers, our ids (output of decoder layer k): 1,29,57")
    parser.add_argument("--batches", type=int, default=4, help="the first is a warm-up, left out of tokens/s")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--mem-fraction", type=float, default=0.6, help="mem_fraction_static of the GPU for SGLang")
    parser.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="an extra ServerArgs field; VALUE is read as JSON when it parses (true, 4, \"x\")")
    parser.add_argument("--rank-tolerance", type=float, default=0.0,
                        help="largest |difference| allowed between ranks' features (TP all-reduces replicate them)")
    parser.add_argument("--compare-transformers", action="store_true")
    return parser.parse_args(argv)


def text_config(model: str) -> dict:
    config = json.loads((Path(model) / "config.json").read_text())
    return config.get("text_config") or config  # multimodal wrappers (Kimi-K2.5) nest the language model's


def engine_args(args) -> dict:
    extra = {}
    for item in args.engine_arg:
        key, _, value = item.partition("=")
        try:
            extra[key] = json.loads(value)
        except json.JSONDecodeError:
            extra[key] = value
    # The KV pool holds one batch; the request table one row per batch row.
    return {"mem_fraction_static": args.mem_fraction, "max_total_tokens": args.rows * args.max_len + 256,
            "max_running_requests": args.rows, **extra}


def make_batch(args, vocab: int, seed: int, device: torch.device) -> TokenBatch:
    """The same batch on every rank: rank 0 draws it, the others receive it (NCCL: on the GPU)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.rows,), generator=generator)
    ids = torch.randint(0, vocab, (args.rows, args.max_len), generator=generator)
    for i, n in enumerate(lengths):
        ids[i, int(n):] = 0
    if dist.is_initialized() and dist.get_world_size() > 1:
        shared = torch.cat([lengths[:, None], ids], dim=1).to(device)  # [B, 1 + T]
        dist.broadcast(shared, src=0)
        lengths, ids = shared[:, 0].cpu(), shared[:, 1:].cpu()
    width = int(lengths.max())
    return TokenBatch(ids[:, :width].contiguous(), lengths, [f"s{seed}-{i}" for i in range(args.rows)])


def real_positions(features: Features, lengths: torch.Tensor):
    """(aux, last) over the real tokens only: [N, n_aux * H], [N, H]."""
    mask = torch.arange(features.last.shape[1])[None, :] < lengths[:, None]  # [B, T]
    mask = mask.to(features.last.device)
    return features.aux[mask], features.last[mask]


def check_shapes(features: Features, batch: TokenBatch, hidden: int, n_aux: int) -> None:
    b, t = batch.input_ids.shape
    assert features.aux.shape == (b, t, n_aux * hidden), f"aux {tuple(features.aux.shape)} != {(b, t, n_aux * hidden)}"
    assert features.last.shape == (b, t, hidden), f"last {tuple(features.last.shape)} != {(b, t, hidden)}"
    aux, last = real_positions(features, batch.lengths)
    assert bool(torch.isfinite(aux).all()) and bool(torch.isfinite(last).all()), "non-finite features"


def rank_difference(tensor: torch.Tensor) -> float:
    """Largest |this rank - rank 0| over all ranks (every rank receives rank 0's tensor)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return 0.0
    reference = tensor.clone()
    dist.broadcast(reference, src=0)
    worst = (tensor.float() - reference.float()).abs().max().reshape(1)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


def relative_row_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    ours, theirs = ours.float(), theirs.float()
    return float(((ours - theirs).norm(dim=-1) / ours.norm(dim=-1).clamp_min(1e-6)).max())


def gathered(value) -> list:
    if not dist.is_initialized():
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def main(argv=None) -> int:
    args = parse_args(argv)
    node = setup_distributed()  # the trainer's own set-up: nccl process group over torchrun's ranks
    say = print if node.main else (lambda *a, **k: None)
    config = text_config(args.model)
    hidden, vocab, layers = config["hidden_size"], config["vocab_size"], [int(k) for k in args.layers.split(",")]
    started = time.perf_counter()
    backend = SGLangFeatures(args.model, args.family, config["num_hidden_layers"], layers, "post_norm", node.rank,
                             node.world, node.device, engine_args(args))
    torch.cuda.synchronize()
    say(f"SGLang {backend.release}: runner built on {node.world} rank(s) in {time.perf_counter() - started:.1f} s")
    torch.cuda.reset_peak_memory_stats()

    tokens, seconds, first = 0, 0.0, None
    for step in range(args.batches):
        batch = make_batch(args, vocab, seed=step, device=node.device)
        torch.cuda.synchronize()
        tick = time.perf_counter()
        features = backend.features(batch)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - tick
        check_shapes(features, batch, hidden, len(layers))
        aux, last = real_positions(features, batch.lengths)
        spread = max(rank_difference(aux), rank_difference(last))
        assert spread <= args.rank_tolerance, f"batch {step}: ranks' features differ by up to {spread:.3g}"
        if step == 0:
            if args.compare_transformers:
                first = (batch, Features(features.aux.cpu(), features.last.cpu()))
            mine = slice(node.rank % args.rows, node.rank % args.rows + 1)  # one row per rank
            sliced = backend.features(batch, mine)
            width = int(batch.lengths[mine].max())
            assert torch.equal(sliced.aux, features.aux[mine, :width]) and torch.equal(sliced.last,
                                                                                      features.last[mine, :width])
        else:
            tokens, seconds = tokens + int(batch.lengths.sum()), seconds + elapsed
        say(f"batch {step}: {int(batch.lengths.sum())} tokens in {elapsed:.3f} s; ranks differ by {spread:.3g}")

    rate = tokens / seconds if seconds else float("nan")
    free, total = torch.cuda.mem_get_info()
    memory = {"rank": node.rank, "tokens_per_s": round(rate, 1),
              "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
              "in_use_gib": round((total - free) / 2**30, 2)}
    for row in gathered(memory):
        say(f"rank {row['rank']}: {row['tokens_per_s']} tokens/s, peak allocated {row['peak_allocated_gib']} GiB, "
            f"in use on the GPU {row['in_use_gib']} GiB")
    backend.close()

    status = 0
    if args.compare_transformers and node.main:
        batch, ours = first
        reference = TransformersFeatures(args.model, layers, "post_norm", node.device,
                                         trust_remote_code=bool(engine_args(args).get("trust_remote_code")))
        expected = reference.features(batch)
        reference.close()
        errors = {}
        for kind in ("aux", "last"):
            want = real_positions(Features(expected.aux.cpu(), expected.last.cpu()), batch.lengths)
            got = real_positions(ours, batch.lengths)
            index = 0 if kind == "aux" else 1
            errors[kind] = relative_row_error(want[index], got[index])
        say(f"transformers vs SGLang, max relative row error: aux {errors['aux']:.4f}, last {errors['last']:.4f}")
        status = 0 if max(errors.values()) < RELATIVE_TOLERANCE else 1
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    say("features smoke test passed" if status == 0 else "features DIFFER from transformers")
    return status


if __name__ == "__main__":
    sys.exit(main())
