"""Hidden-state capture with SGLang used as a library, on the GPU node, in the node's own SGLang
environment (`data.sglang_python`). This module imports SGLang only inside `SGLangCapturePass.start`.

Why this path (DESIGN §3 weighs two): `--enable-return-aux-hidden-states` returns the aux states of a
plain target, with no draft and without reaching into SGLang's model runner. Over HTTP every token
would cost n_aux x hidden JSON floats (Kimi-K2.5: ~21 k floats per token), so the engine runs
in-process instead and rows go straight into our shards. That flag returns the aux states *in place
of* the last hidden state, so capture runs two passes, one engine at a time (they cannot share the
GPUs): aux states, then the last hidden state (after the final norm: what SGLang returns).

Pinned releases: 0.5.23 (the first with `enable_return_aux_hidden_states`). Prefix caching is off and
chunked prefill is disabled so every prompt token gets its row.

Run on the node:  python -m eagle3.engines.sglang_capture --config C [--set section.field=value ...]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from typing import Callable

import torch

from eagle3.config import PipelineConfig
from eagle3.errors import Eagle3Error
from eagle3.formats import engines
from eagle3.procs import ProcessTree, terminate_on_sigterm

SUPPORTED_RELEASES = engines.ReleaseRange("0.5.23", "0.5.23")
STOP_GRACE_S = 20.0  # under the 30 s a cancelled flow run has between SIGTERM and SIGKILL


def engine_args(config: PipelineConfig, kind: str, release: str) -> dict:
    """sglang.Engine keyword arguments for one capture pass (a ServerArgs field each)."""
    args = {
        "model_path": config.target.path,
        "tp_size": config.serving.tp,
        "disable_radix_cache": True,  # a prefix-cache hit returns rows for the uncached tokens only
        "chunked_prefill_size": -1,  # rows of middle chunks are dropped otherwise
        **config.data.sglang_engine_args,
    }
    if kind == "aux_hidden":
        ids = engines.sglang_ids_for_layers(
            list(config.data.aux_layers), config.target.family, release, config.target.num_hidden_layers
        )
        # The flag is only accepted with an EAGLE3 algorithm, which picks the capture convention; no draft loads.
        args.update(
            enable_return_aux_hidden_states=True,
            speculative_algorithm="EAGLE3",
            return_aux_hidden_state_layer_ids=ids,
        )
    else:
        args.update(enable_return_hidden_states=True)
    return args


class SGLangCapturePass:
    """One kind of hidden state from an in-process sglang.Engine."""

    def __init__(self, config: PipelineConfig, kind: str):
        self.config, self.kinds = config, (kind,)
        self.release: str | None = None
        self.engine = None

    def start(self, log: Callable[[str], None]) -> None:
        import sglang

        self.release = sglang.__version__
        if engines.parse_release(self.release) not in SUPPORTED_RELEASES:
            raise Eagle3Error(
                f"SGLang {self.release} is not supported for capture (supported: {SUPPORTED_RELEASES}); "
                "install a supported release in the node's SGLang environment"
            )
        args = engine_args(self.config, self.kinds[0], self.release)
        log(f"capture: starting sglang.Engine {self.release} for {self.kinds[0]} with {args}")
        self.engine = sglang.Engine(**args)

    def stop(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    def states(self, sequences: list[list[int]]) -> list[dict[str, torch.Tensor]]:
        # One new token: with max_new_tokens 0 SGLang returns no rows. Block 0 is the prompt's [T, D].
        outputs = self.engine.generate(input_ids=sequences, sampling_params={"max_new_tokens": 1}, return_hidden_states=True)
        return [
            {self.kinds[0]: torch.tensor(out["meta_info"]["hidden_states"][0], dtype=torch.bfloat16)} for out in outputs
        ]


def sglang_passes(config: PipelineConfig) -> list[SGLangCapturePass]:
    return [SGLangCapturePass(config, "aux_hidden"), SGLangCapturePass(config, "last_hidden")]


def node_command(config: PipelineConfig, config_path: str, overrides: list[str]) -> list[str]:
    """The command that runs capture on the GPU node with its SGLang python."""
    sets = [f"--set={item}" for item in overrides]
    return [config.data.sglang_python, "-m", "eagle3.engines.sglang_capture", "--config", str(config_path), *sets]


def run_on_node(config: PipelineConfig, config_path: str, overrides: list[str], log: Callable[[str], None]) -> None:
    """Run the node command in its own process group; Ctrl-C or a failure never leaves it behind."""
    command = node_command(config, config_path, overrides)
    log(f"capture: running {' '.join(command)}")
    try:
        process = subprocess.Popen(command, start_new_session=True)
    except OSError as err:
        raise Eagle3Error(f"cannot start {command[0]} (data.sglang_python): {err.strerror}") from None
    try:
        with terminate_on_sigterm():  # so the stop below runs
            code = process.wait()
    finally:
        ProcessTree([process]).stop(STOP_GRACE_S, log)
    if code != 0:
        raise Eagle3Error(f"SGLang capture exited with status {code}: {' '.join(command)}")


def main(argv: list[str] | None = None) -> int:
    from eagle3.config import load_config
    from eagle3.data.capture import capture

    parser = argparse.ArgumentParser(description="capture hidden states with SGLang on the GPU node")
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
        capture(config, passes=sglang_passes(config))
    except Eagle3Error as err:
        print(f"eagle3 capture: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
