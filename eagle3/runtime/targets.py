"""The target's identity and its loaders: what a dataset records so a later stage can refuse data that was made
with another target, tokenizer, chat template or layers; and the one place the target's tokenizer and model are
loaded (so every engine runs it with the same trust_remote_code and precision)."""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from eagle3.config.run import TargetSection
from eagle3.errors import Eagle3Error, UnreadableInput
from eagle3.fsutil import cached_sha256
from eagle3.target.info import read_target_info
from eagle3.target.files import config_files, tokenizer_files


class DataMismatch(Eagle3Error):
    """Data made under other settings than the config asks for."""


def _path_and_trust(target: TargetSection | str | Path, trust_remote_code: bool) -> tuple[str, bool]:
    if isinstance(target, TargetSection):
        return target.path, target.trust_remote_code
    return str(target), trust_remote_code


def load_tokenizer(target: TargetSection | str | Path, trust_remote_code: bool = False):
    """The target's tokenizer (a TargetSection brings its own trust_remote_code). The flag is always passed, so
    transformers never asks on stdin whether to run the target's code: untrusted, it refuses."""
    from transformers import AutoTokenizer

    path, trust = _path_and_trust(target, trust_remote_code)
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust)
    except (OSError, ValueError) as err:
        raise UnreadableInput(f"{path}: cannot load the target's tokenizer ({str(err).splitlines()[0]})"
                              + ("" if trust else "; if it needs its own code, set target.trust_remote_code")) from None


def resolve_dtype(path: str | Path, dtype: str = "auto") -> str:
    """The precision the target runs in: `dtype`, or with "auto" the one its config.json (or text_config) names,
    else float32."""
    if dtype != "auto":
        return dtype
    named = read_target_info(path).dtype if (Path(path) / "config.json").is_file() else None
    return named if named in ("float32", "bfloat16", "float16") else "float32"


def load_target_model(target: TargetSection | str | Path, trust_remote_code: bool = False, dtype: str | None = None):
    """The target as a transformers causal LM, in eval mode, in the precision resolve_dtype gives (a TargetSection
    brings its own trust_remote_code and dtype; `dtype` overrides)."""
    import torch
    from transformers import AutoModelForCausalLM

    path, trust = _path_and_trust(target, trust_remote_code)
    wanted = dtype or (target.dtype if isinstance(target, TargetSection) else "auto")
    precision = getattr(torch, resolve_dtype(path, wanted))
    return AutoModelForCausalLM.from_pretrained(path, dtype=precision, trust_remote_code=trust).eval()


def eos_ids_of(model) -> frozenset[int]:
    """The token ids that end the target's turn (generation config first, as SGLang reads them)."""
    return eos_set(model.generation_config.eos_token_id, model.config.eos_token_id)


def target_eos_ids(path: str | Path) -> frozenset[int]:
    """eos_ids_of from the target directory's files, without loading the model."""
    def field(name: str):
        file = Path(path) / name
        return json.loads(file.read_text()).get("eos_token_id") if file.is_file() else None

    return eos_set(field("generation_config.json"), field("config.json"))


def eos_set(first, fallback) -> frozenset[int]:
    eos = fallback if first is None else first
    return frozenset() if eos is None else frozenset(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))


def files_hash(directory: Path, names: tuple[str, ...]) -> str | None:
    digest, found = hashlib.sha256(), False
    for name in names:
        path = directory / name
        if path.is_file():
            found = True
            digest.update(name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest() if found else None


def target_identity(target: TargetSection) -> dict:
    directory = Path(target.path)
    return {
        "path": target.path,
        "family": target.family,
        "num_hidden_layers": target.num_hidden_layers,
        "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
        "dtype": resolve_dtype(directory, target.dtype),
        "config_sha256": files_hash(directory, config_files(directory)),
        "tokenizer_sha256": files_hash(directory, tokenizer_files(directory)),
    }


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def weight_files(directory: Path) -> list[Path]:
    return sorted(p for p in Path(directory).rglob("*") if p.suffix in WEIGHT_SUFFIXES and p.is_file())


def has_weight_files(target: TargetSection) -> bool:
    """Whether target.path is a local directory with weights (not a hub id, nor a path only the nodes have)."""
    return Path(target.path).is_dir() and bool(weight_files(Path(target.path)))


def weights_sha256(target: TargetSection) -> str:
    """The content hash of the target's weight files (every file under its directory with a weight suffix, by
    relative path): a fine-tune with the same config and tokenizer gets another. Each file is hashed once per process
    while unchanged, the files on threads of their own (hashlib lets go of the GIL): Kimi-K2.5's 553 GiB read at the
    disk's speed."""
    directory = Path(target.path)
    files = weight_files(directory)
    if not files:
        raise UnreadableInput(f"{directory}: no weight files ({', '.join(WEIGHT_SUFFIXES)}) under target.path")
    with ThreadPoolExecutor(max_workers=min(8, len(files))) as pool:
        hashes = list(pool.map(cached_sha256, files))
    digest = hashlib.sha256()
    for path, sha in zip(files, hashes):
        digest.update(f"{path.relative_to(directory).as_posix()}\0{sha}\n".encode())
    return digest.hexdigest()


def check_same(what: str, recorded: dict, expected: dict, keys: tuple[str, ...]) -> None:
    """Raise DataMismatch naming every key whose recorded value differs from the expected one."""
    differences = [
        f"{key}: data has {recorded.get(key)!r}, config gives {expected.get(key)!r}"
        for key in keys
        if recorded.get(key) != expected.get(key)
    ]
    if differences:
        raise DataMismatch(f"{what} was made with other settings than this config: " + "; ".join(differences))
