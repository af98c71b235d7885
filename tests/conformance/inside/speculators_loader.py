"""Probe: speculators' own `SpeculatorModel.from_pretrained` on checkpoints, then its EAGLE-3 forward.

Job: {"drafts": {name: dir}, "loads": N, "forward": {"draft": name, "inputs": file, "outputs": file, "steps": K}}.
Each draft is loaded N times; the answer gives, per draft, what the loader raised, or per load every tensor of the
model's state dict as [dtype, shape, sha256 of its bytes], plus the model class. The forward runs on one more load
in float32: hidden_states = the aux states [1, T, n_aux * H] and input_ids [1, T] from `inputs` (safetensors),
position ids 0..T-1, one document; the logits of each TTT step (lm_head's outputs, [1, T, draft_vocab]) go to
`outputs`.
"""

import hashlib
from importlib.metadata import version

import torch
from safetensors.torch import load_file, save_file


def digest(tensor: torch.Tensor) -> list:
    data = tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    return [str(tensor.dtype).removeprefix("torch."), list(tensor.shape), hashlib.sha256(data).hexdigest()]


def load(path: str):
    from speculators import SpeculatorModel

    return SpeculatorModel.from_pretrained(path)


def loads(path: str, count: int) -> dict:
    try:
        models = [load(path) for _ in range(count)]
    except Exception as err:  # the answer: a loader that refuses the checkpoint
        return {"raised": f"{type(err).__name__}: {err}"}
    return {"class": type(models[0]).__name__,
            "loads": [{name: digest(t) for name, t in model.state_dict().items()} for model in models]}


def forward(path: str, inputs: str, outputs: str, steps: int) -> None:
    model = load(path).float().eval()
    tensors = load_file(inputs)
    ids = tensors["input_ids"]
    logits = []
    model.lm_head.register_forward_hook(lambda module, args, out: logits.append(out.detach().clone()))
    with torch.no_grad():
        model(hidden_states=tensors["hidden_states"], input_ids=ids, document_ids=torch.zeros_like(ids),
              position_ids=torch.arange(ids.shape[1]).unsqueeze(0), ttt_steps=steps)
    save_file({f"step{k}": step.contiguous() for k, step in enumerate(logits)}, outputs)


def run(job: dict) -> dict:
    answer = {"version": version("speculators"), "transformers": version("transformers"),
              "drafts": {name: loads(path, job["loads"]) for name, path in job["drafts"].items()}}
    spec = job.get("forward")
    if spec:
        forward(job["drafts"][spec["draft"]], spec["inputs"], spec["outputs"], spec["steps"])
    return answer
