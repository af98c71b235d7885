"""Run a release's own command-line parser (`ServerArgs.add_cli_args` on an argparse parser, as its
`prepare_server_args` builds it) on the commands the launcher writes.

Job: {"commands": {label: [args after `-m sglang.launch_server`]}, optional "construct": {label: {field: value}},
optional "algorithms": [names]}.
Answer: {"parsed": {label: {dest: value} | {"error": text}}, "options": {dest: [option strings]}}:
every spelling the release accepts per destination, to compare the launcher's alias table with. With "construct":
"constructed" {label: {"accepted": true} | {"error": text}}, the release's ServerArgs(**fields) on a tiny CPU model,
resolved as its launcher resolves it (__post_init__, or resolve_once from 0.5.20): its own checks. With
"algorithms": "algorithms" {name: the release's SpeculativeAlgorithm.from_string(name) | {"error": text}} (what its
scheduler and model runner call).
"""

import argparse
import contextlib
import io
import tempfile

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
    answer = {"parsed": parsed, "options": options, "allow_abbrev": parser.allow_abbrev}
    if "construct" in job:
        answer["constructed"] = {label: _construct(fields) for label, fields in job["construct"].items()}
    if "algorithms" in job:
        answer["algorithms"] = {name: _algorithm(name) for name in job["algorithms"]}
    return answer


def _construct(fields: dict) -> dict:
    import counting  # its tiny target and draft configs (ServerArgs reads configs only)

    with tempfile.TemporaryDirectory() as directory:
        target, draft = counting._tiny_model(directory)
        try:
            args = ServerArgs(model_path=target, speculative_draft_model_path=draft, device="cpu",
                              skip_tokenizer_init=True, **fields)
            if hasattr(args, "resolve_once"):  # 0.5.20 on: construction stays raw, the launcher resolves
                args.resolve_once()
        except Exception as error:  # the refusal is the answer
            return {"error": f"{type(error).__name__}: {error}"}
    return {"accepted": True}


def _algorithm(name: str):
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    try:
        return SpeculativeAlgorithm.from_string(name).name
    except Exception as error:  # the refusal is the answer
        return {"error": f"{type(error).__name__}: {error}"}
