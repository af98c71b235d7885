"""What every command group shares: the exit codes and the --config/--set arguments of the pipeline's commands."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

EXIT_OK, EXIT_PROBLEMS, EXIT_UNREADABLE = 0, 1, 2


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--config", type=Path, required=True, help="pipeline config (YAML)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    return parser


def load_run_config(args: argparse.Namespace, needs: tuple[str, ...] = ()):
    """The config of --config/--set; `needs`: the sections a training-only config leaves out that this command uses."""
    from eagle3.config import check_target_trust, require_sections
    from eagle3.resolve import load_config

    config = load_config(args.config, args.overrides)
    require_sections(config, needs, args.command)
    check_target_trust(config)
    return config


# The SGLang release is `--release` everywhere (serving.release in the config); the old per-command spellings work
# for one more release, with a line saying so.
DEPRECATED_RELEASE_FLAGS = ("--engine-version", "--engine-release")


class DeprecatedFlag(argparse.Action):
    """An old spelling of the flag `new`: it still sets that flag's value, and says the new name once."""

    def __init__(self, *args, new: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.new = new

    def __call__(self, parser, namespace, value, option_string=None):
        print(f"eagle3: {option_string} is deprecated and goes in the next release; write {self.new} {value}",
              file=sys.stderr)
        setattr(namespace, self.dest, value)


def add_deprecated_flag(parser: argparse.ArgumentParser, new: str, *old: str, **kwargs) -> None:
    """The old spellings `old` of the flag `new` (already added), kept working and hidden from --help."""
    parser.add_argument(*old, dest=new.removeprefix("--").replace("-", "_"), action=DeprecatedFlag, new=new,
                        help=argparse.SUPPRESS, **kwargs)


def add_release_argument(parser: argparse.ArgumentParser, help: str) -> None:
    parser.add_argument("--release", help=help)
    add_deprecated_flag(parser, "--release", *DEPRECATED_RELEASE_FLAGS)


def exec_flow(module: str, arguments: list[str]) -> None:
    """Become `python -m flows.<module>` of the checkout this library runs from, so a signal to this process reaches
    the flow. Only the library is installed: flows/ and tasks/ are the deployments' code (prefect.yaml's
    entrypoints), run from the checkout, never installed as top-level packages that could shadow a user's own."""
    checkout = Path(__file__).resolve().parents[2]
    if not (checkout / "flows" / f"{module}.py").is_file():
        from eagle3.errors import Eagle3Error

        raise Eagle3Error(f"this command runs flows/{module}.py of the project's checkout, and none is beside this "
                          f"eagle3 ({checkout}): install eagle3 from its checkout (`make install`, or `pip install -e "
                          ".` there)")
    path = os.pathsep.join([str(checkout), *filter(None, [os.environ.get("PYTHONPATH")])])
    os.execve(sys.executable, [sys.executable, "-m", f"flows.{module}", *arguments], {**os.environ, "PYTHONPATH": path})
