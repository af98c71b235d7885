"""Capture on the GPU node: the data stage's feature work (eagle3/data/capture.py) run with the `sglang` feature
backend, one torchrun rank per GPU, the target tensor-parallel over them (serving.tp ranks), in the node's own
SGLang environment (`data.sglang_python`). Every rank computes the same batches; rank 0 writes the shards.

Run on the node:  torchrun --standalone --nproc-per-node TP -m eagle3.engines.sglang_capture --config RESOLVED
(the pipeline starts it itself: `run_on_node`).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Callable

from eagle3.config import PipelineConfig
from eagle3.errors import Eagle3Error
from eagle3.procs import ProcessTree, terminate_on_sigterm

STOP_GRACE_S = 20.0  # under the 30 s a cancelled flow run has between SIGTERM and SIGKILL


def node_command(config: PipelineConfig, resolved: Path | str) -> list[str]:
    """The command that runs capture on the GPU node with its SGLang python, one rank per tensor-parallel GPU."""
    return [config.data.sglang_python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(config.serving.tp), "-m", "eagle3.engines.sglang_capture", "--config", str(resolved)]


def run_on_node(config: PipelineConfig, resolved: Path | str, log: Callable[[str], None]) -> None:
    """Run the node command in its own process group; Ctrl-C or a failure never leaves it behind."""
    command = node_command(config, resolved)
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
    from eagle3.engines.features import target_backend
    from eagle3.train.parallel import setup_distributed

    parser = argparse.ArgumentParser(description="capture the data stage's features with SGLang on the GPU node")
    parser.add_argument("--config", required=True, help="the run's resolved config (run.dir/config.resolved.yaml)")
    args = parser.parse_args(argv)
    dist = setup_distributed()  # SGLang's parallel state is built on this group: the target is TP over all ranks
    try:
        config = load_config(args.config)
        capture(config, log=print if dist.main else (lambda line: None),
                backend_for=lambda: target_backend(config, dist.device, dist.rank, dist.world), main=dist.main)
    except Eagle3Error as err:
        print(f"eagle3 capture: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
