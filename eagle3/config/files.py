"""Config files as mappings of sections: `extends`, a file's fields over the config it extends, and `--set`
overrides (eagle3.config validates the result)."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from eagle3.errors import ConfigError

# Fields that moved, (section, old name) -> new name: a config written before still loads and means the same, with one
# line naming the new place (docs/configuration.md, "Renamed fields"). "Engine" now means a serving engine only.
RENAMED = {("data", "engine"): "generator", ("data", "capture_engine"): "feature_backend"}


def read_config_file(path: Path, extended_by: tuple[Path, ...] = ()) -> dict:
    """A config file's sections; with `extends: OTHER.yaml` (a path relative to the file), OTHER's sections with this
    file's fields over them (configs/tiny-qwen3-cpu.yaml is tiny-cpu.yaml on another target)."""
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except (IsADirectoryError, UnicodeDecodeError):
        raise ConfigError(f"{path}: not a YAML text file") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}".replace("\n", " ")) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    renamed_fields(raw, str(path))
    base = raw.pop("extends", None)
    if base is None:
        return raw
    if not isinstance(base, str):
        raise ConfigError(f"{path}: extends is {base!r}; write the path of the config it extends, e.g. tiny-cpu.yaml")
    chain = (*extended_by, path.resolve())
    base_path = path.parent / base
    if base_path.resolve() in chain:
        raise ConfigError(f"{path}: extends {base}, which extends {path.name} again: remove one of the two")
    return merged_sections(read_config_file(base_path, chain), raw)


def merged_sections(base: dict, own: dict) -> dict:
    """`own` over `base`, field by field: a mapping merges into the base's mapping, any other value replaces it."""
    merged = dict(base)
    for key, value in own.items():
        both_mappings = isinstance(value, dict) and isinstance(merged.get(key), dict)
        merged[key] = merged_sections(merged[key], value) if both_mappings else value
    return merged


def renamed_fields(raw: dict, where: str) -> None:
    """Each field of RENAMED given under its old name moved to its new one, in place, saying so in one line."""
    for (section, old), new in RENAMED.items():
        fields = raw.get(section)
        if isinstance(fields, dict) and old in fields:
            if new in fields:
                raise ConfigError(f"{where}: {section}.{old} is the old name of {section}.{new}, and both are given: "
                                  f"keep {section}.{new}")
            fields[new] = fields.pop(old)
            print(renamed_note(where, section, old, new), file=sys.stderr)


def renamed_note(where: str, section: str, old: str, new: str) -> str:
    return f"eagle3: {where}: {section}.{old} is now {section}.{new} (the old name still works; write the new one)"


def apply_override(raw: dict, item: str) -> str:
    """Apply one `a.b.c=value` override in place; the value is parsed as YAML (so 3, true, [0,1] work). A field of
    RENAMED given by its old name sets the new one."""
    dotted, sep, text = item.partition("=")
    if not sep or not dotted:
        raise ConfigError(f"--set {item!r}: expected section.field=value")
    if (new := RENAMED.get(tuple(dotted.split(".")))) is not None:
        section, old = dotted.split(".")
        print(renamed_note("--set", section, old, new), file=sys.stderr)
        dotted = f"{section}.{new}"
    keys = dotted.split(".")
    node = raw
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {item!r}: '{key}' is a value, not a section")
        node = child
    try:
        node[keys[-1]] = yaml.safe_load(text)
    except yaml.YAMLError:
        node[keys[-1]] = text
    return dotted
