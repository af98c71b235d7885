"""What every command group shares: the exit codes and the --config/--set arguments of the pipeline's commands."""

from __future__ import annotations

import argparse
from pathlib import Path

EXIT_OK, EXIT_PROBLEMS, EXIT_UNREADABLE = 0, 1, 2


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--config", type=Path, required=True, help="pipeline config (YAML)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    return parser


def load_run_config(args: argparse.Namespace):
    from eagle3.config import load_config

    return load_config(args.config, args.overrides)
