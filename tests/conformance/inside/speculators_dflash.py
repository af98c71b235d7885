"""Probe: speculators' own DFlashDraftModel on a DFlash checkpoint: what its loader builds, and its blocks.

Job: {"draft": dir, "inputs": file, "outputs": file}. The loader's model: its class and every tensor of its state dict
as [dtype, shape, sha256 of its bytes]. The blocks: `inputs` (safetensors) holds hidden_states [1, T, n_aux * H] and
input_ids [1, T]; with every position a loss position and T - block_size anchors, speculators anchors a block at each
of 0 .. T - block_size - 1 (sorted); `outputs` gets each block's logits [N, block_size, V] (its lm_head over its final
norm) and the anchors [N]. Eager attention: the flex attention it defaults to compiles its mask.
"""

from importlib.metadata import version

import torch
from safetensors.torch import load_file, save_file

from speculators_loader import digest


def run(job: dict) -> dict:
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

    config = DFlashSpeculatorConfig.from_pretrained(job["draft"])
    config.transformer_layer_config._attn_implementation = "eager"
    model = DFlashDraftModel.from_pretrained(job["draft"], config=config).float().eval()
    tensors = load_file(job["inputs"])
    ids, hidden = tensors["input_ids"], tensors["hidden_states"]
    length, size = ids.shape[1], model.block_size
    with torch.no_grad():
        _, logits, _, _, indices = model._backbone_forward(
            hidden, ids, loss_mask=torch.ones_like(ids), document_ids=torch.zeros_like(ids),
            verifier_last_hidden_states=torch.zeros(1, length, config.transformer_layer_config.hidden_size),
            max_anchors=length - size)
    save_file({"logits": logits.view(-1, size, logits.shape[-1]).contiguous(),
               "anchors": indices[::size].contiguous()}, job["outputs"])
    return {"version": version("speculators"), "class": type(model).__name__,
            "state": {name: digest(t) for name, t in model.state_dict().items()}}
