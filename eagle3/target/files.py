"""What a target directory's tokenizer and chat template read, from its files alone: the files that make its
identity, the Python files it asks transformers to run (auto_map), and the variable its template switches
thinking with."""

from __future__ import annotations

import json
import re
from pathlib import Path

from eagle3.errors import UnreadableInput

# Every file a tokenizer or its chat template may read, whatever its kind: fast (tokenizer.json), tiktoken (Kimi),
# sentencepiece, WordPiece / BPE vocabularies. The Python files auto_map names are added by tokenizer_files.
# TOKENIZER_MODEL_FILES: one of them makes a directory hold a tokenizer.
TOKENIZER_MODEL_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "tiktoken.model", "vocab.json",
                         "vocab.txt")
TOKENIZER_FILES = TOKENIZER_MODEL_FILES + ("merges.txt", "added_tokens.json", "special_tokens_map.json",
                                           "chat_template.jinja", "chat_template.json")
# The variable a chat template reads to switch thinking: Qwen's and Kimi's (Moonshot's API) names.
THINKING_SWITCHES = ("enable_thinking", "thinking")
GENERATION_TAGS = re.compile(r"{%-?\s*(end)?generation\s*-?%}")


def _json(file: Path) -> dict:
    if not file.is_file():
        return {}
    try:
        value = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UnreadableInput(f"{file}: not readable JSON ({err})") from None
    return value if isinstance(value, dict) else {}


def remote_code_files(directory: Path, json_name: str) -> list[str]:
    """The Python files in `directory` that `json_name`'s auto_map asks transformers to run (e.g. Kimi's
    tokenizer_config.json: {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", null]} -> tokenization_kimi.py).
    References into another repository ("repo--module.Class") name no local file and are left out."""
    names = []
    for value in (_json(Path(directory) / json_name).get("auto_map") or {}).values():
        for reference in value if isinstance(value, list) else [value]:
            if isinstance(reference, str) and "--" not in reference:
                name = reference.rpartition(".")[0].replace(".", "/") + ".py"
                if name not in names and (Path(directory) / name).is_file():
                    names.append(name)
    return names


def tokenizer_files(directory: Path) -> tuple[str, ...]:
    """The files the target's tokenizer and chat template read, its own Python code included."""
    return TOKENIZER_FILES + tuple(remote_code_files(directory, "tokenizer_config.json"))


def config_files(directory: Path) -> tuple[str, ...]:
    """The files the target's model config reads: config.json and the Python code its auto_map names."""
    return ("config.json", *remote_code_files(directory, "config.json"))


def untrusted_code_problem(directory: Path) -> str | None:
    """Why loading this target needs target.trust_remote_code (the first file that asks), or None."""
    for json_name in ("tokenizer_config.json", "config.json"):
        files = remote_code_files(directory, json_name)
        if files:
            return (f"{Path(directory) / json_name} names Python code in auto_map ({', '.join(files)}), which "
                    "transformers runs to load the target")
    return None


def chat_template_text(directory: Path) -> str | None:
    """The target's default chat template, where transformers reads it: chat_template.jinja, chat_template.json,
    then tokenizer_config.json (a string, or a list of named templates)."""
    directory = Path(directory)
    if (directory / "chat_template.jinja").is_file():
        return (directory / "chat_template.jinja").read_text()
    template = _json(directory / "chat_template.json").get("chat_template")
    if template is None:
        template = _json(directory / "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


def thinking_switches(template: str | None) -> tuple[str, ...]:
    """The thinking switches (THINKING_SWITCHES) the template reads: the variables it uses without setting them."""
    if not template:
        return ()
    import jinja2
    from jinja2 import meta

    environment = jinja2.Environment(extensions=["jinja2.ext.loopcontrols", "jinja2.ext.do"])
    plain = GENERATION_TAGS.sub("", template)  # transformers' own {% generation %} block marks no variable
    try:
        used = meta.find_undeclared_variables(environment.parse(plain))
    except jinja2.TemplateSyntaxError as err:
        raise UnreadableInput(f"the target's chat template does not parse ({err.message}, line {err.lineno})") from None
    return tuple(name for name in THINKING_SWITCHES if name in used)
