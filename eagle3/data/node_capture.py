"""Capture where `data.feature_backend` says: here (transformers), or on the GPU node - the data stage's feature work
(eagle3/data/capture.py) run with the `sglang` feature backend, one torchrun rank per GPU, the target tensor-parallel over them (serving.tp ranks), in the node's own
SGLang environment (`data.sglang_python`). Every rank computes the same batches; rank 0 writes the shards.

Run on the node:  torchrun --standalone --nproc-per-node TP -m eagle3.data.node_capture --config RESOLVED
(the pipeline starts it itself: `run_on_node`).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Callable

from eagle3.resolve import load_config
from eagle3.config.data import DataSection
from eagle3.config.run import RunSection, TargetSection
from eagle3.config.serving import ServingSection
from eagle3.config.training import TrainingSection
from eagle3.data.capture import Log, capture, dataset_dir
from eagle3.data.suite_capture import capture_suites, suite_features_dir
from eagle3.distributed import setup_distributed
from eagle3.runtime.backends import target_backend
from eagle3.errors import Eagle3Error
from eagle3.procs import STOP_GRACE_S, ProcessTree, terminate_on_sigterm

def node_command(data: DataSection, serving: ServingSection, resolved: Path | str, suites: bool = False) -> list[str]:
    """The command that runs capture on the GPU node with its SGLang python, one rank per tensor-parallel GPU
    (`suites`: the suite features stage's capture)."""
    return [data.sglang_python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(serving.tp), "-m", "eagle3.data.node_capture", "--config", str(resolved), *(["--suites"] * suites)]


def run_on_node(data: DataSection, serving: ServingSection, resolved: Path | str, log: Callable[[str], None],
                suites: bool = False) -> None:
    """Run the node command in its own process group; Ctrl-C or a failure never leaves it behind."""
    command = node_command(data, serving, resolved, suites)
    log(f"capture: running {' '.join(command)}")
    try:
        # stdin closed: nothing the node command loads (a target's remote code included) can wait on a prompt
        process = subprocess.Popen(command, start_new_session=True, stdin=subprocess.DEVNULL)
    except OSError as err:
        raise Eagle3Error(f"cannot start {command[0]} (data.sglang_python): {err.strerror}") from None
    try:
        with terminate_on_sigterm():  # so the stop below runs
            code = process.wait()
    finally:
        ProcessTree([process]).stop(STOP_GRACE_S, log)
    if code != 0:
        raise Eagle3Error(f"SGLang capture exited with status {code}: {' '.join(command)}")


def capture_with_engine(run: RunSection, data: DataSection, target: TargetSection, training: TrainingSection,
                        serving: ServingSection | None, resolved: Path | str, log: Log = print, store=None) -> Path:
    """Capture with `data.feature_backend`: here (transformers, with the feature store `store` when there is one), or
    SGLang on the GPU node (on serving.tp GPUs) - torchrun in the node's SGLang environment reading the run's
    resolved config. Returns the training data set's directory."""
    if data.feature_backend == "sglang":
        run_on_node(data, serving, resolved, log=log)
        return dataset_dir(run, training)
    return capture(run, data, target, training, log=log, store=store)


def capture_suites_with_engine(run: RunSection, data: DataSection, target: TargetSection,
                               serving: ServingSection | None, resolved: Path | str, log: Log = print) -> Path:
    """The suite features stage's capture with `data.feature_backend`, as `capture_with_engine`'s."""
    if data.feature_backend == "sglang":
        run_on_node(data, serving, resolved, log=log, suites=True)
        return suite_features_dir(run)
    return capture_suites(run, data, target, log=log)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="capture the data stage's features with SGLang on the GPU node")
    parser.add_argument("--config", required=True, help="the run's resolved config (run.dir/config.resolved.yaml)")
    parser.add_argument("--suites", action="store_true", help="the other suites' sequences (eagle3.data.suite_capture) "
                        "instead of the training data set and the held-out prompts'")
    args = parser.parse_args(argv)
    dist = setup_distributed()  # SGLang's parallel state is built on this group: the target is TP over all ranks
    try:
        config = load_config(args.config)
        log = print if dist.main else (lambda line: None)

        def backend_for():
            return target_backend(config.data, config.target, dist.device, dist.rank, dist.world)

        if args.suites:
            capture_suites(config.run, config.data, config.target, log=log, backend_for=backend_for, main=dist.main)
        else:
            capture(config.run, config.data, config.target, config.training, log=log, backend_for=backend_for,
                    main=dist.main)
    except Eagle3Error as err:
        print(f"eagle3 capture: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
