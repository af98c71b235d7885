"""python -m eagle3.train --config C [--set section.field=value ...]   (also under torchrun)"""

import argparse
import os
import sys

import torch.distributed as dist

from eagle3.resolve import load_config
from eagle3.errors import Eagle3Error
from eagle3.train.trainer import Trainer

STOPPED_BY_SIGTERM = 143  # 128 + SIGTERM: a clean stop with a checkpoint saved, but not a finished run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eagle3.train", description=__doc__)
    parser.add_argument("--config", required=True, help="the run's resolved config (run.dir/config.resolved.yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    args = parser.parse_args(argv)
    try:
        trainer = Trainer(load_config(args.config, args.overrides))
        trainer.run()
        code = STOPPED_BY_SIGTERM if trainer.stopped else 0
    except (Eagle3Error, OSError) as err:
        print(f"eagle3 train: {err}", file=sys.stderr)
        code = 2
    if dist.is_initialized():
        leave_process_group(code)
    return code


def leave_process_group(code: int) -> None:
    """Leave together, then exit without the interpreter's teardown: gloo and FSDP background threads
    destroyed during teardown abort the process now and then ("terminate called without an active
    exception"), turning a finished run into a failed one."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
