"""Probe: an EAGLE-3 draft as SpecForge itself writes one, by its own code end to end.

Its trainer's path, step by step: the draft class from a draft config (`AutoDraftModelConfig.from_file`,
`AutoDraftModel.from_config`: SpecForge's `LlamaForCausalLMEagle3`), the vocab map from token counts
(`process_token_dict_to_mappings`) copied into the class's d2t / t2d buffers, the embedding frozen, the checkpoint
`training_state.pt` ({"draft_state_dict": its state dict without the frozen embedding, "strategy": "eagle3"}), then its
SGLang exporter `export_to_sglang` (the class rebuilt from the config, the checkpoint loaded, `save_pretrained`).
The weights come from the job, under the class's own parameter names (loaded strictly but for the embedding and the
vocab buffers), so the test knows what the draft computes.

Job: {"draft_config": file, "counts": [a count per target id], "weights": safetensors file, "work": dir, "out": dir}.
Answer: {"version", "transformers", "class": module.name of the draft class, "missing": the parameters the weights
left out, "d2t": the map it computed, "files": what the export wrote}.
"""

import os
from collections import Counter
from importlib.metadata import version

import placeholders

# specforge.data.preprocessing imports `datasets` at module level (the type of its dataset functions); the vocab-map
# function used here never calls it, and it is not installed here.
placeholders.install(("datasets",))

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402


def run(job: dict) -> dict:
    from specforge.data.preprocessing import process_token_dict_to_mappings
    from specforge.export.to_sglang import export_to_sglang
    from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig

    config = AutoDraftModelConfig.from_file(job["draft_config"])
    model = AutoDraftModel.from_config(config)
    counts = Counter(dict(enumerate(job["counts"])))  # target id -> count, in id order (its ties go to the first)
    d2t, t2d = process_token_dict_to_mappings(counts, config.draft_vocab_size, config.vocab_size)
    model.d2t.copy_(d2t)
    model.t2d.copy_(t2d)
    missing, unexpected = model.load_state_dict(load_file(job["weights"]), strict=False)
    if unexpected:
        raise ValueError(f"weights the class does not have: {unexpected}")
    model.freeze_embedding()
    state = {name: tensor for name, tensor in model.state_dict().items() if "embed" not in name.lower()}
    checkpoint = os.path.join(job["work"], "training_state.pt")
    torch.save({"draft_state_dict": state, "strategy": "eagle3", "global_step": 0}, checkpoint)
    export_to_sglang(checkpoint, job["draft_config"], job["out"])
    return {"version": version("specforge"), "transformers": version("transformers"),
            "class": f"{type(model).__module__}.{type(model).__name__}", "missing": sorted(missing),
            "d2t": d2t.tolist(), "files": sorted(os.listdir(job["out"]))}
