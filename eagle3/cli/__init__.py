"""`eagle3 …`: the command line. Errors are one line naming the input and the fix, never a traceback."""

from __future__ import annotations

import argparse
import sys

from eagle3.cli.checkpoints import add_checkpoint_commands
from eagle3.cli.common import EXIT_PROBLEMS, EXIT_UNREADABLE, exec_flow
from eagle3.cli.configs import add_config_commands
from eagle3.cli.registry import add_registry_commands
from eagle3.cli.serving import add_serving_commands
from eagle3.cli.steps import add_step_commands
from eagle3.errors import ConversionError, Eagle3Error

__all__ = ["build_parser", "main"]


PASSED_ON = ("run", "monitor")  # commands whose own parser (in flows/) reads every argument after the command


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unread = parser.parse_known_args(argv)
    if args.command in PASSED_ON:
        # argparse leaves an option before the first positional (`eagle3 run --help`) out of the remainder
        args.arguments = unread + args.arguments
    elif unread:
        parser.error(f"unrecognized arguments: {' '.join(unread)}")
    try:
        return args.handler(args)
    except ConversionError as err:
        print(f"eagle3: cannot convert: {err}", file=sys.stderr)
        return EXIT_PROBLEMS
    except (Eagle3Error, OSError, ValueError) as err:  # OSError: a path the user gave that cannot be read
        print(f"eagle3: {err}", file=sys.stderr)
        return EXIT_UNREADABLE


def build_parser() -> argparse.ArgumentParser:
    """The commands in the order `eagle3 --help` lists them."""
    parser = argparse.ArgumentParser(prog="eagle3", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    add_checkpoint_commands(commands)
    add_step_commands(commands)
    add_serving_commands(commands)
    run = commands.add_parser("run", help="run the whole pipeline as the Prefect flow `eagle3` (see flows/run.py)",
                              add_help=False)
    run.add_argument("arguments", nargs=argparse.REMAINDER, help="CONFIG [--set ...] [--mode full|retrain|benchmark]")
    run.set_defaults(handler=run_flow)
    monitor = commands.add_parser("monitor", help="one window of production's acceptance on live traffic against its "
                                  "promotion, as the flow's monitor mode (see flows/monitor.py)", add_help=False)
    monitor.add_argument("arguments", nargs=argparse.REMAINDER, help="CONFIG [--set ...]")
    monitor.set_defaults(handler=run_monitor)
    add_registry_commands(commands)
    add_config_commands(commands)
    return parser


def run_flow(args: argparse.Namespace) -> int:
    """The flow lives outside the library (which never imports Prefect): this process becomes the flow's, so a
    signal to it reaches the flow directly."""
    exec_flow("run", args.arguments)


def run_monitor(args: argparse.Namespace) -> int:
    """As run_flow: the monitor's flow run is this process."""
    exec_flow("monitor", args.arguments)
