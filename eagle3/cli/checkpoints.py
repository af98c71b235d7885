"""`eagle3 inspect | convert | validate`: a draft checkpoint or vocab map, read, converted and checked on its own."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from eagle3.cli.common import EXIT_OK, EXIT_PROBLEMS, add_deprecated_flag, add_release_argument
from eagle3.shape import DEFAULT_NUM_STEPS


def add_checkpoint_commands(commands) -> None:
    inspect = commands.add_parser("inspect", help="diagnose a vocab map or a draft checkpoint")
    inspect.add_argument("path", type=Path)
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    inspect.set_defaults(handler=run_inspect)

    convert = commands.add_parser("convert", help="convert a draft checkpoint between layouts")
    convert.add_argument("src", type=Path)
    convert.add_argument("dst", type=Path)
    convert.add_argument("--to", required=True, choices=("sglang", "speculators", "native"))
    add_release_argument(convert, "SGLang release the export is for (decides the aux ids)")
    convert.add_argument("--target", type=Path, help="target model directory (its config.json; for --to speculators "
                         "also its embedding, and the verifier the export names)")
    convert.add_argument("--target-family", help="SGLang model file of the target, e.g. llama, deepseek_v2")
    convert.add_argument("--weight-prefix", default="", help="name prefix of the target's tensors, e.g. "
                         "'language_model.' (target.weight_prefix)")
    convert.add_argument("--verifier", help="--to speculators: the verifier the export names, e.g. the hub id the "
                         "target is published under, where the export is loaded on another machine (default: the "
                         "--target directory, resolved)")
    convert.add_argument("--num-steps", type=int, default=DEFAULT_NUM_STEPS,
                         help="drafting steps per verify step it is served with (speculators' speculative_tokens)")
    convert.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    convert.set_defaults(handler=run_convert)

    validate = commands.add_parser("validate", help="check a draft against what the serving engine will do")
    validate.add_argument("path", type=Path)
    loaders = ("sglang", "speculators")
    validate.add_argument("--loader", default="sglang", choices=loaders,
                          help="the loader to check against: SGLang's, or speculators' from_pretrained")
    add_deprecated_flag(validate, "--loader", "--engine", choices=loaders)  # "engine" means a serving engine
    add_release_argument(validate, "the loader's release (SGLang: default the strictest rules; speculators: the one "
                         "release whose loader was read)")
    validate.add_argument("--target", type=Path, help="target model directory (its config.json)")
    validate.add_argument("--target-family", help="SGLang model file of the target, if --target is not given")
    validate.add_argument("--data-manifest", type=Path, help="manifest of the training data (captured layers)")
    validate.add_argument("--context-length", type=int, help="the serving context length")
    validate.add_argument("--json", action="store_true", help="machine-readable output")
    validate.set_defaults(handler=run_validate)


def run_inspect(args: argparse.Namespace) -> int:
    from eagle3.algorithms.eagle3.inspect import inspect_path, render

    result = inspect_path(args.path)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return EXIT_OK


def run_convert(args: argparse.Namespace) -> int:
    from eagle3.algorithms import EAGLE3, draft_algorithm
    from eagle3.algorithms.base import ExportTarget
    from eagle3.errors import ConversionError
    from eagle3.algorithms.eagle3.checkpoint import convert
    from eagle3.target.info import read_target_info
    from eagle3.model.weights import target_verifier

    family, num_layers, verifier = args.target_family, None, None
    if args.verifier is not None and (args.to != "speculators" or args.target is None):
        raise ConversionError("--verifier names the verifier of a speculators export: use it with --to speculators "
                              "and --target DIR (the target's embedding is read from there)")
    if args.target is not None:
        info = read_target_info(args.target)
        family, num_layers = family or info.family, info.num_hidden_layers
        if args.to == "speculators":
            verifier = target_verifier(args.target, args.weight_prefix, args.verifier)
    entry = draft_algorithm(args.src)
    if entry is EAGLE3:
        out = convert(args.src, args.dst, to=args.to, target_family=family, release=args.release,
                      target_num_layers=num_layers, overwrite=args.overwrite, num_steps=args.num_steps,
                      verifier=verifier)
    else:  # another kind's trained draft, written as its export stage writes it
        if args.dst.exists() and not args.overwrite:
            raise ConversionError(f"{args.dst}: already exists; choose another destination or pass --overwrite")
        if args.to == "speculators" and verifier is None:
            raise ConversionError("--to speculators names the target as the verifier: give --target DIR")
        target = ExportTarget(family, args.release, num_layers, args.num_steps, verifier)
        out = entry.export(args.src, args.dst, args.to, target, log=lambda line: None)
    print(f"wrote {args.to} layout to {out}")
    return EXIT_OK


def run_validate(args: argparse.Namespace) -> int:
    from eagle3.algorithms import EAGLE3, draft_algorithm
    from eagle3.algorithms.eagle3.validate import validate

    entry = draft_algorithm(args.path)
    if entry is not EAGLE3:  # the draft's own checks (EAGLE-3's take a target family besides)
        report = entry.validate(args.path, args.loader, args.release, args.target, args.data_manifest,
                                args.context_length)
    else:
        report = validate(args.path, engine=args.loader, release=args.release, target=args.target,
                          data_manifest=args.data_manifest, context_length=args.context_length,
                          target_family=args.target_family)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(render_report(report))
    return EXIT_OK if report.ok else EXIT_PROBLEMS


def render_report(report) -> str:
    release = report.engine_release or "unknown release (strictest rules)"
    lines = [f"{report.path}: {report.engine} {release}"]
    for severity in ("error", "warning", "unknown"):
        for problem in report.of(severity):
            lines.append(f"  {severity.upper():7s} {problem.code}: {problem.message}")
            lines.append(f"          fix: {problem.fix}")
    errors, warnings, unknowns = (len(report.of(s)) for s in ("error", "warning", "unknown"))
    verdict = "valid" if report.ok else "NOT valid"
    lines.append(f"{verdict}: {errors} error(s), {warnings} warning(s), {unknowns} check(s) not run for lack of input")
    return "\n".join(lines)
