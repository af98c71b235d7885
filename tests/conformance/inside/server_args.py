"""Run a release's own command-line parser (`ServerArgs.add_cli_args` on an argparse parser, as its
`prepare_server_args` builds it) on the commands the launcher writes.

Job: {"commands": {label: [args after `-m sglang.launch_server`]}}.
Answer: {"parsed": {label: {dest: value} | {"error": text}}, "options": {dest: [option strings]}}:
every spelling the release accepts per destination, to compare the launcher's alias table with.
"""

import argparse
import contextlib
import io

from sglang.srt.server_args import ServerArgs

JSON_TYPES = (str, int, float, bool, type(None), list)


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> dict:
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            namespace = parser.parse_args(argv)
    except SystemExit:  # argparse reports a bad command by exiting; its message is the answer
        return {"error": stderr.getvalue().strip().splitlines()[-1]}
    return {dest: value for dest, value in vars(namespace).items() if isinstance(value, JSON_TYPES)}


def run(job: dict) -> dict:
    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    options = {action.dest: action.option_strings for action in parser._actions if action.option_strings}
    parsed = {label: _parse(parser, argv) for label, argv in job["commands"].items()}
    return {"parsed": parsed, "options": options, "allow_abbrev": parser.allow_abbrev}
