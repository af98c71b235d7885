"""The target's identity and tokenizer: what a dataset records so a later stage can refuse data that
was made with another target, tokenizer, chat template or layers."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from eagle3.config.sections import TargetSection
from eagle3.errors import Eagle3Error, UnreadableInput

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "chat_template.jinja", "special_tokens_map.json")


class DataMismatch(Eagle3Error):
    """Data made under other settings than the config asks for."""


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except OSError as err:
        raise UnreadableInput(f"{path}: cannot load the target's tokenizer ({str(err).splitlines()[0]})") from None


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
        "config_sha256": files_hash(directory, ("config.json",)),
        "tokenizer_sha256": files_hash(directory, TOKENIZER_FILES),
    }


def check_same(what: str, recorded: dict, expected: dict, keys: tuple[str, ...]) -> None:
    """Raise DataMismatch naming every key whose recorded value differs from the expected one."""
    differences = [
        f"{key}: data has {recorded.get(key)!r}, config gives {expected.get(key)!r}"
        for key in keys
        if recorded.get(key) != expected.get(key)
    ]
    if differences:
        raise DataMismatch(f"{what} was made with other settings than this config: " + "; ".join(differences))
