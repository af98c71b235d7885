"""`python registry_faults.py FAULT ARGS...`: a process that dies with SIGKILL at one chosen point of the registry's
work, as an out-of-memory killer or a lost node would end it (tests/test_registry_faults.py):

- `publish SECTION_JSON VERSION DIR`: takes the registry's lock, publishes VERSION (one layout, `sglang`, from DIR),
  prints "published", and dies before the pointer move;
- `prune SECTION_JSON RUN_DIR KEEP`: the retention after a promotion, dying once it has deleted one file of the first
  run it removes.
"""

import json
import os
import shutil
import signal
import sys
from pathlib import Path

from eagle3.config.deployment import RegistrySection
from eagle3.config.run import RunSection
from eagle3.deployment.promotion import prune_after_promotion
from eagle3.registry.lock import Holder, registry_lock
from eagle3.registry.registry import open_registry


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def publish(section: RegistrySection, version: str, directory: str) -> None:
    registry = open_registry(section)
    with registry_lock(registry, Holder.here("killed-run", lease_s=section.lock_lease_s), print):
        registry.publish(version, {"sglang": Path(directory)}, {"run": "killed-run"})
        print("published", flush=True)
        die()  # before promote: the pointer never moves


def prune(section: RegistrySection, run_dir: str, keep: str) -> None:
    def delete_one_file_then_die(path, *args, **kwargs):
        next(p for p in Path(path).rglob("*") if p.is_file()).unlink()
        die()

    shutil.rmtree = delete_one_file_then_die
    run = RunSection(name="retrain", dir=Path(run_dir), keep_runs=int(keep))
    prune_after_promotion(run, section, open_registry(section), print)


if __name__ == "__main__":
    fault, section, *args = sys.argv[1:]
    {"publish": publish, "prune": prune}[fault](RegistrySection(**json.loads(section)), *args)
