"""EAGLE-3 drafts trained elsewhere, judged for serving by one SGLang release on one target and converted to the
sglang layout, with a record of every step: what `eagle3 registry import` stores as a version
(eagle3/deployment/imports.py).

Every layout adapter reads: SGLang's and SpecForge's `LlamaForCausalLMEagle3` (`midlayer.*` or `layers.0.*`),
speculators' (`Eagle3DraftModel`, or `Eagle3Speculator` of its older releases) and this project's native layout. A
draft is refused on its validation errors, each named by its problem code (eagle3.contract.problems):
- a draft SGLang loads as it is (the sglang layout, or one no adapter converts: an EAGLE-1/2 draft, another
  architecture) is validated as that release's loader reads it, before anything is converted: names the loader
  skips (`layers.0.*` up to 0.5.11), the vocab map (an absolute d2t), the aux ids under the family's rule against
  the layers the pipeline captures (ids shifted by one), the config, the shapes, the context length;
- a native or speculators draft is converted first, and conversion rewrites names and ids, so on the source only
  what conversion carries over unchanged is checked: the switches the release lacks (speculators'
  `norm_before_residual`: no SGLang release has it) and the vocab map;
- the converted sglang export is then validated as the pipeline validates its own exports (eagle3/export.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from eagle3.algorithms.eagle3.checkpoint import (
    NativeDraft, draft_config, layout_of, native_tensors, read_checkpoint, write_draft_files,
)
from eagle3.algorithms.eagle3.layouts.shared import RawCheckpoint
from eagle3.algorithms.eagle3.loader_checks import sample_names
from eagle3.algorithms.eagle3.validate import validate, validate_for_conversion
from eagle3.draft.files import CONFIG_FILE
from eagle3.fsutil import atomic_directory
from eagle3.validation.external import Converted, Log, Serving, refuse_on_errors, sglang_where, summary

CONVERTED_FIRST = ("native", "speculators")  # layouts SGLang cannot load as they are: judged after conversion


def convert_external(source: Path, dst: Path, serving: Serving, log: Log = print) -> Converted:
    """Validate the draft at `source` for `serving`, convert it to the sglang layout at `dst` (which appears only
    when the converted export validates too) and say what was done; raise ImportRefused on validation errors."""
    raw = read_checkpoint(source)
    done = Converted(raw.layout, [f"found the {raw.layout} layout: architectures {raw.config.get('architectures')}, "
                                  f"{len(raw.tensors)} tensors"])
    if raw.layout in CONVERTED_FIRST:
        config = draft_config(raw, serving.family, serving.release, serving.num_layers, log)
        report = validate_for_conversion(raw, config.flags(), serving.release, serving.vocab_size)
        checked = "checked what conversion carries over (switches, vocab map)"
    else:
        report = validate(source, "sglang", serving.release, serving.target, context_length=serving.context_length,
                          target_family=serving.family, data_layers=serving.data_layers)
        checked = "validated as the release's loader reads it"
    refuse_on_errors(str(source), report)
    done.validation["source"] = report.to_dict()
    done.steps.append(f"{checked} for {serving.describe()}: {summary(report)}")
    if raw.layout not in CONVERTED_FIRST:
        config = draft_config(raw, serving.family, serving.release, serving.num_layers, log)
    draft = NativeDraft(config, native_tensors(raw))
    done.steps += renames(raw) + [
        f"decoded the config: aux layers {config.aux_layers} (output of decoder layer k), switches "
        f"{config.flags() or 'none'}, {config.torch_dtype}, draft vocabulary {config.draft_vocab_size}"]
    with atomic_directory(Path(dst), overwrite=True) as tmp:
        write_draft_files(draft, tmp, "sglang", serving.family, serving.release, source=str(source),
                          num_steps=serving.num_steps)
        ids = json.loads((tmp / CONFIG_FILE).read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        done.steps.append(f"wrote the sglang layout for {sglang_where(serving.release)}: midlayer.* names, "
                          f"eagle_config.eagle_aux_hidden_state_layer_ids {ids}")
        served = validate(tmp, "sglang", serving.release, serving.target, context_length=serving.context_length,
                          target_family=serving.family, data_layers=serving.data_layers)
        refuse_on_errors(str(source), served)
    served.path = str(dst)  # where it now is, not the temporary directory it was validated in
    done.validation["sglang"] = served.to_dict()
    done.steps.append(f"validated the sglang layout as the pipeline's exports are: {summary(served)}")
    for line in done.steps:
        log(f"import: {line}")
    return done


def renames(raw: RawCheckpoint) -> list[str]:
    """The tensor renames and drops converting to the canonical (midlayer.*) names makes, as sentences."""
    adapter = layout_of(raw)
    moved = [f"{name} -> {canonical}" for name in sorted(raw.tensors)
             if (canonical := adapter.canonical_name(name, raw.config)) not in (None, name)]
    dropped = [name for name in sorted(raw.tensors) if name.removeprefix("model.") == "embed_tokens.weight"]
    steps = [f"renamed {len(moved)} tensor(s): {sample_names(moved, 2)}"] if moved else []
    if dropped:
        steps.append(f"dropped {', '.join(dropped)}: the target's embedding (SGLang uses the target's own)")
    return steps
