"""`eagle3 …`: the command line. Errors are one line naming the input and the fix, never a traceback."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import yaml

from eagle3.errors import ConfigError, ConversionError, Eagle3Error

EXIT_OK, EXIT_PROBLEMS, EXIT_UNREADABLE = 0, 1, 2


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except ConversionError as err:
        print(f"eagle3: cannot convert: {err}", file=sys.stderr)
        return EXIT_PROBLEMS
    except (Eagle3Error, OSError, ValueError) as err:  # OSError: a path the user gave that cannot be read
        print(f"eagle3: {err}", file=sys.stderr)
        return EXIT_UNREADABLE


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle3", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    inspect = commands.add_parser("inspect", help="diagnose a vocab map or a draft checkpoint")
    inspect.add_argument("path", type=Path)
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    inspect.set_defaults(handler=run_inspect)

    convert = commands.add_parser("convert", help="convert a draft checkpoint between layouts")
    convert.add_argument("src", type=Path)
    convert.add_argument("dst", type=Path)
    convert.add_argument("--to", required=True, choices=("sglang", "speculators", "native"))
    convert.add_argument("--engine-version", help="SGLang release the export is for (decides the aux ids)")
    convert.add_argument("--target", type=Path, help="target model directory (its config.json)")
    convert.add_argument("--target-family", help="SGLang model file of the target, e.g. llama, deepseek_v2")
    convert.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    convert.set_defaults(handler=run_convert)

    validate = commands.add_parser("validate", help="check a draft against what the serving engine will do")
    validate.add_argument("path", type=Path)
    validate.add_argument("--engine", default="sglang", choices=("sglang",))
    validate.add_argument("--engine-version", help="SGLang release (default: the strictest rules)")
    validate.add_argument("--target", type=Path, help="target model directory (its config.json)")
    validate.add_argument("--target-family", help="SGLang model file of the target, if --target is not given")
    validate.add_argument("--data-manifest", type=Path, help="manifest of the training data (captured layers)")
    validate.add_argument("--context-length", type=int, help="the serving context length")
    validate.add_argument("--json", action="store_true", help="machine-readable output")
    validate.set_defaults(handler=run_validate)

    data = commands.add_parser("data", help="synthetic data: regenerate answers, capture hidden states")
    data_commands = data.add_subparsers(dest="data_command", required=True)
    for name, handler, text in (
        ("regenerate", run_regenerate, "the target writes the assistant turns of the training prompts"),
        ("capture", run_capture, "capture the target's hidden states for the regenerated samples"),
    ):
        add_config_arguments(data_commands.add_parser(name, help=text)).set_defaults(handler=handler)
    quality = add_config_arguments(data_commands.add_parser(
        "quality", help="the data-quality report (data.quality bars) of the regenerated replies, or of the assistant "
        "turns of a conversations file (exit 1: a bar is crossed)"))
    quality.add_argument("--file", type=Path, help="JSONL conversations (ShareGPT or OpenAI messages) to check instead")
    quality.set_defaults(handler=run_quality)

    tiny = commands.add_parser("make-tiny-target", help="build (or reuse) the tiny CPU target model")
    tiny.add_argument("out", type=Path)
    tiny.add_argument("--micro", action="store_true", help="the smaller, faster variant the tests use")
    tiny.set_defaults(handler=run_make_tiny_target)

    vocab = commands.add_parser("vocab", help="the draft vocabulary map")
    vocab_commands = vocab.add_subparsers(dest="vocab_command", required=True)
    build = vocab_commands.add_parser("build", help="build d2t/t2d from the regenerated training split")
    add_config_arguments(build).set_defaults(handler=run_vocab_build)

    simulate = add_config_arguments(
        commands.add_parser("simulate", help="offline acceptance: replay chain drafting on the held-out prompts")
    )
    simulate.add_argument("--checkpoint", type=Path, help="the served draft (default: run.dir/export/sglang)")
    simulate.set_defaults(handler=run_simulate)

    diagnose = add_config_arguments(
        commands.add_parser("diagnose", help="why served acceptance falls short of the simulated one: a checklist")
    )
    diagnose.add_argument("--checkpoint", type=Path, help="the served draft (default: run.dir/export/sglang)")
    diagnose.add_argument("--engine-version", help="the live release (default: serving.release)")
    diagnose.set_defaults(handler=run_diagnose)

    bench = commands.add_parser("bench", help="serving benchmark: accept length, throughput, latency from a live server")
    bench.add_argument("--url", required=True, help="the server under test (SGLang /generate protocol)")
    bench.add_argument("--prompts", type=Path, help="JSONL of input_ids / text / messages (default with --config: held-out)")
    bench.add_argument("--tokenizer", help="model directory whose chat template renders `messages` (default: target.path)")
    bench.add_argument("--baseline-url", help="the same target without a draft: speedup and output identity")
    bench.add_argument("--max-new-tokens", type=int, help="default: benchmark.max_new_tokens, or 128 without --config")
    bench.add_argument("--concurrency", type=int, help="requests in flight (default: benchmark.concurrency's first)")
    bench.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    bench.add_argument("--out", type=Path, help="result JSON (default with --config: run.dir/bench/served.json)")
    bench.add_argument("--config", type=Path, help="pipeline config: defaults and the held-out prompts")
    bench.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    bench.set_defaults(handler=run_bench)

    serve = commands.add_parser("serve", help="the reference server: SGLang's HTTP API with speculative decoding "
                                "(chains and trees, greedy and sampled)")
    serve.add_argument("--target", type=Path, required=True, help="target model directory (transformers)")
    serve.add_argument("--draft", type=Path, help="served draft checkpoint (sglang layout); none = plain decoding")
    serve.add_argument("--num-steps", type=int, default=3, help="drafting steps (the tree's depth) per verify step")
    serve.add_argument("--eagle-topk", type=int, default=1, help="branches per drafting step (1: a chain)")
    serve.add_argument("--num-draft-tokens", type=int, help="tree nodes verified per step, the root included "
                       "(default: num_steps + 1, the chain)")
    serve.add_argument("--seed", type=int, default=0, help="seed of the coins sampled requests draw")
    serve.add_argument("--engine-release", help="SGLang release whose loader and aux-id rules to apply")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, required=True)
    serve.set_defaults(handler=run_serve)

    run = commands.add_parser("run", help="run the whole pipeline as the Prefect flow `eagle3` (see flows/run.py)",
                              add_help=False)
    run.add_argument("arguments", nargs=argparse.REMAINDER, help="CONFIG [--set ...] [--mode full|retrain|benchmark]")
    run.set_defaults(handler=run_flow)

    add_registry_commands(commands)

    config = commands.add_parser("config", help="validate a pipeline config (and that it fits the GPUs); print it resolved")
    config.add_argument("path", type=Path)
    config.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    config.set_defaults(handler=run_config)

    plan = commands.add_parser("plan", help="per-GPU memory of every GPU stage against node.gpu_memory_gib (exit 1: "
                               "a stage does not fit)")
    plan.add_argument("path", type=Path)
    plan.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(handler=run_plan)
    return parser


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--config", type=Path, required=True, help="pipeline config (YAML)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    return parser


def load_run_config(args: argparse.Namespace):
    from eagle3.config import load_config

    return load_config(args.config, args.overrides)


def run_make_tiny_target(args: argparse.Namespace) -> int:
    from eagle3.engines.tiny import MICRO, TINY, build_tiny_target

    out = build_tiny_target(args.out, MICRO if args.micro else TINY)
    print(f"tiny target ready at {out}")
    return EXIT_OK


def run_regenerate(args: argparse.Namespace) -> int:
    from eagle3.data.regenerate import regenerate

    regenerate(load_run_config(args))
    return EXIT_OK


def run_quality(args: argparse.Namespace) -> int:
    from eagle3.data.conversation import encode
    from eagle3.data.quality import describe_figures, replies_in_file, report
    from eagle3.data.regenerate import REGEN_DIR, regenerated_replies
    from eagle3.engines.targets import load_tokenizer

    config = load_run_config(args)
    tokenizer = load_tokenizer(config.target.path)
    if args.file is None:
        source, limit = config.stage_dir("data") / REGEN_DIR, config.data.max_new_tokens
        replies = regenerated_replies(source, tokenizer)
    else:
        source, limit = args.file, None
        replies = replies_in_file(args.file, lambda text: encode(tokenizer, text))
    quality = report(replies, config.data.quality, limit, tokenizer.decode)
    print(f"{source}: {describe_figures(quality['figures'])}")
    for problem in quality["problems"]:
        print(f"  {'waived' if problem['waived'] else 'FAILED'} {problem['code']}: {problem['message']}")
    print(f"data quality {'passed' if quality['passed'] else 'FAILED'}")
    return EXIT_OK if quality["passed"] else EXIT_PROBLEMS


def run_capture(args: argparse.Namespace) -> int:
    from eagle3.data.node_capture import capture_with_engine

    from eagle3.config import resolved_config_file

    config = load_run_config(args)
    capture_with_engine(config, resolved_config_file(config))
    return EXIT_OK


def run_vocab_build(args: argparse.Namespace) -> int:
    from eagle3.data.vocab import build_vocab

    build_vocab(load_run_config(args))
    return EXIT_OK


def run_simulate(args: argparse.Namespace) -> int:
    from eagle3.bench.simulate import simulate

    config = load_run_config(args)
    simulate(config, args.checkpoint or config.stage_dir("export") / "sglang")
    return EXIT_OK


def run_diagnose(args: argparse.Namespace) -> int:
    """Reads run.dir/bench/simulated.json and served.json (written by `simulate` and `bench`)."""
    from eagle3.bench.diagnose import diagnose
    from eagle3.data.capture import dataset_dir
    from eagle3.fsutil import read_json

    config = load_run_config(args)
    bench = config.stage_dir("bench")
    simulated = read_json(bench / "simulated.json", "missing: run `eagle3 simulate` first")
    served = read_json(bench / "served.json", "missing: run `eagle3 bench --config …` first")
    longest = max(((row["prompt_tokens"] or 0) + row["completion_tokens"] for row in served.get("prompts", [])), default=None)
    result = diagnose(
        args.checkpoint or config.stage_dir("export") / "sglang",
        args.engine_version or config.serving.release,
        Path(config.target.path),
        dataset_dir(config),
        simulated.get("accept_length"),
        served.get("accept_length"),
        longest,
    )
    print(result.render())
    return EXIT_PROBLEMS if result.failed else EXIT_OK


def run_bench(args: argparse.Namespace) -> int:
    from eagle3.bench.client import DEFAULT_MAX_NEW_TOKENS, load_prompt_file, render_table, run_benchmark
    from eagle3.config.sections import BenchmarkSection
    from eagle3.engines.targets import load_tokenizer
    from eagle3.fsutil import atomic_write_json

    if args.config is None and (args.prompts is None or args.overrides):
        raise ValueError("bench: give --prompts FILE, or --config (held-out prompts and defaults); --set needs --config")
    config = load_run_config(args) if args.config is not None else None
    settings = config.benchmark if config else BenchmarkSection(max_new_tokens=DEFAULT_MAX_NEW_TOKENS, num_prompts=1)
    tokenizer_path = args.tokenizer or (config.target.path if config else None)
    tokenizer = load_tokenizer(str(tokenizer_path)) if tokenizer_path else None
    thinking = config.data.thinking if config else False
    if args.prompts is not None:
        prompts = load_prompt_file(args.prompts, tokenizer, thinking)
    else:
        from eagle3.data.regenerate import heldout_prompt_ids

        prompts = heldout_prompt_ids(config, tokenizer)
    pick = lambda given, default: default if given is None else given  # noqa: E731  (0 is refused, not replaced)
    result = run_benchmark(args.url, prompts, pick(args.max_new_tokens, settings.max_new_tokens),
                           pick(args.concurrency, settings.production_concurrency), settings.request_timeout_s,
                           settings.retries, baseline_url=args.baseline_url, temperature=args.temperature)
    print("\n".join(render_table(result)))
    out = args.out or (config.stage_dir("bench") / "served.json" if config else None)
    if out is not None:
        atomic_write_json(out, result)
        print(f"bench: wrote {out}")
    return EXIT_PROBLEMS if result["mismatches"] else EXIT_OK


def run_inspect(args: argparse.Namespace) -> int:
    from eagle3.formats.inspect import inspect_path, render

    result = inspect_path(args.path)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return EXIT_OK


def run_convert(args: argparse.Namespace) -> int:
    from eagle3.formats.checkpoint import convert
    from eagle3.formats.target import read_target_info

    family, num_layers = args.target_family, None
    if args.target is not None:
        info = read_target_info(args.target)
        family, num_layers = family or info.family, info.num_hidden_layers
    out = convert(
        args.src,
        args.dst,
        to=args.to,
        target_family=family,
        engine_release=args.engine_version,
        target_num_layers=num_layers,
        overwrite=args.overwrite,
    )
    print(f"wrote {args.to} layout to {out}")
    return EXIT_OK


def run_validate(args: argparse.Namespace) -> int:
    from eagle3.formats.validate import validate

    report = validate(
        args.path,
        engine=args.engine,
        engine_release=args.engine_version,
        target=args.target,
        data_manifest=args.data_manifest,
        context_length=args.context_length,
        target_family=args.target_family,
    )
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


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from eagle3.serve.reference import create_app
    from eagle3.shape import DraftShape

    try:
        shape = DraftShape(args.num_steps, args.eagle_topk, args.num_draft_tokens)
    except ValueError as err:
        raise ConfigError(f"--num-steps/--eagle-topk/--num-draft-tokens: {err}") from None
    app = create_app(args.target, args.draft, shape, engine_release=args.engine_release, seed=args.seed)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return EXIT_OK


def run_flow(args: argparse.Namespace) -> int:
    """The flow lives outside the library (which never imports Prefect): this process becomes the flow's, so a
    signal to it reaches the flow directly."""
    os.execv(sys.executable, [sys.executable, "-m", "flows.run", *args.arguments])


def run_config(args: argparse.Namespace) -> int:
    from eagle3.config import check_local_inputs, load_config
    from eagle3.plan import require_fit

    config = load_config(args.path, args.overrides)
    check_local_inputs(config)
    require_fit(config, args.path)
    print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")
    return EXIT_OK


def run_plan(args: argparse.Namespace) -> int:
    from eagle3.config import load_config
    from eagle3.plan import plan_memory

    plan = plan_memory(load_config(args.path, args.overrides))
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print("\n".join(plan.table()))
    for refusal in plan.refusals():
        print(f"eagle3 plan: {args.path}: {refusal}", file=sys.stderr)
    return EXIT_OK if plan.all_fit else EXIT_PROBLEMS


def add_registry_commands(commands) -> None:
    """`eagle3 registry …`: read the registry a config names, and move its production pointer by hand."""
    registry = commands.add_parser("registry", help="the draft registry: versions, the production pointer, history")
    registry_commands = registry.add_subparsers(dest="registry_command", required=True)
    add_config_arguments(
        registry_commands.add_parser("list", help="versions (production marked *) with their served acceptance")
    ).set_defaults(handler=run_registry_list)
    show = add_config_arguments(registry_commands.add_parser("show", help="a version's manifest, summarized"))
    show.add_argument("version")
    show.add_argument("--json", action="store_true", help="the whole manifest as JSON")
    show.set_defaults(handler=run_registry_show)
    promote = add_config_arguments(
        registry_commands.add_parser("promote", help="run the promotion gate; if it passes, point production at VERSION")
    )
    promote.add_argument("version")
    promote.add_argument("--force", action="store_true", help="promote even if the gate rejects (history: forced)")
    promote.add_argument("--reason", help="a note for the history, e.g. why a rejection is overridden")
    promote.set_defaults(handler=run_registry_promote)
    rollback = add_config_arguments(
        registry_commands.add_parser("rollback", help="point production back at its previous version")
    )
    rollback.add_argument("--to", metavar="VERSION", help="this version instead of the previous one")
    rollback.add_argument("--reason", default="manual rollback", help="why, for the history")
    rollback.set_defaults(handler=run_registry_rollback)
    history = add_config_arguments(
        registry_commands.add_parser("history", help="every promotion, rejection and rollback, oldest first")
    )
    history.add_argument("--json", action="store_true", help="machine-readable output")
    history.set_defaults(handler=run_registry_history)


def open_config_registry(args: argparse.Namespace):
    from eagle3.registry.registry import open_registry

    config = load_run_config(args)
    return config, open_registry(config.registry, log=lambda line: print(line, file=sys.stderr))


def describe_served(manifest: dict) -> str:
    served = (manifest.get("metrics") or {}).get("served") or {}
    shown = {name: "n/a" if served.get(name) is None else f"{served[name]:.3f}" for name in ("accept_length", "accept_rate")}
    return f"served accept length {shown['accept_length']}, accept rate {shown['accept_rate']}"


def run_registry_list(args: argparse.Namespace) -> int:
    _, registry = open_config_registry(args)
    pointer, _ = registry.production()
    production = pointer["version"] if pointer else None
    manifests = sorted((registry.manifest(v) for v in registry.versions()), key=lambda m: (m.get("created", ""), m["version"]))
    previous = f" (previous: {pointer['previous']})" if pointer and pointer.get("previous") else ""
    print(f"registry {registry.location}: {len(manifests)} version(s), production: {production or 'none'}{previous}")
    for manifest in manifests:
        mark = "*" if manifest["version"] == production else " "
        print(f"{mark} {manifest['version']}  {manifest.get('created', '?')}  {describe_served(manifest)}")
    return EXIT_OK


def run_registry_show(args: argparse.Namespace) -> int:
    from eagle3.registry.registry import metrics_of
    from eagle3.shape import DraftShape

    _, registry = open_config_registry(args)
    manifest = registry.manifest(args.version)
    if args.json:
        print(json.dumps(manifest, indent=2, sort_keys=True))
        return EXIT_OK
    pointer, _ = registry.production()
    role = " (production)" if pointer and pointer["version"] == args.version else ""
    files = manifest.get("files", {})
    metrics = manifest.get("metrics") or {}
    served, simulated = metrics.get("served") or {}, metrics.get("simulated") or {}
    print(f"version: {manifest['version']}{role}")
    print(f"files: {len(files)} in {', '.join(manifest.get('layouts', []))} "
          f"({sum(entry['bytes'] for entry in files.values()):,} bytes)")
    print(f"metrics: {describe_served(manifest)}, simulated accept length {simulated.get('accept_length', 'n/a')}, "
          f"{served.get('output_tokens_per_s', 'n/a')} output tokens/s, {served.get('lost_requests', 'n/a')} lost "
          f"request(s), engine release {metrics.get('engine_release', 'n/a')}")
    if manifest.get("serving"):
        gate_view = metrics_of(manifest)
        print("production serves it with: " + (f"{gate_view.throughput}, speedup {gate_view.speedup:.2f}x"
              if gate_view.speedup else f"{DraftShape.of(manifest['serving']).label()} (throughput not measured)"))
    for key in sorted(set(manifest) - {"version", "layouts", "files", "metrics"}):
        value = manifest[key]
        if isinstance(value, dict) and len(value) > 6:  # e.g. the whole pipeline config: too long for a summary
            print(f"{key}: {{{len(value)} fields, see --json}}")
        else:
            print(f"{key}: {value if isinstance(value, str) else json.dumps(value, sort_keys=True)}")
    return EXIT_OK


def run_registry_promote(args: argparse.Namespace) -> int:
    """The gate decides as in the pipeline (candidate vs production metrics from their manifests); a rejection
    is recorded, and --force overrides it with the gate's reasons kept in the history."""
    from eagle3.registry.registry import decide_against_production, metrics_of

    config, registry = open_config_registry(args)
    candidate = registry.manifest(args.version)
    previous = registry.production_version()
    if previous == args.version:
        print(f"{args.version} is already production: nothing to do")
        return EXIT_OK
    decision = decide_against_production(registry, metrics_of(candidate), previous, config.gate)
    reasons = [f"{reason.rule}: {reason.message}" for reason in decision.reasons] or [decision.summary()]
    reasons += [f"note: {args.reason}"] if args.reason else []
    if not decision.promote and not args.force:
        registry.record("rejected", args.version, reasons, by="cli")
        print(f"{args.version}: not promoted, the gate rejects it:")
        print("\n".join(f"  {reason}" for reason in reasons))
        print(f"production stays {previous or 'unset'}; --force promotes anyway (recorded as forced)")
        return EXIT_PROBLEMS
    event = "promoted" if decision.promote else "forced"
    moved = registry.promote(args.version, previous, reasons, by="cli", event=event)
    print(f"production: {moved['version']} (was {moved['previous'] or 'unset'}), {event}")
    return EXIT_OK


def run_registry_rollback(args: argparse.Namespace) -> int:
    from eagle3.registry.registry import RegistryError

    _, registry = open_config_registry(args)
    pointer, _ = registry.production()
    if pointer and pointer.get("previous") is None and args.to is None:
        # the library would leave no production version (the state before the first promotion); by hand, say which
        raise RegistryError(f"production {pointer['version']} has no previous version to roll back to; "
                            "name one with --to VERSION")
    moved = registry.rollback([args.reason], by="cli", to=args.to, expected=pointer["version"] if pointer else None)
    print(f"production: {moved['version']} (rolled back from {moved['previous']})")
    return EXIT_OK


def run_registry_history(args: argparse.Namespace) -> int:
    _, registry = open_config_registry(args)
    entries = registry.history()
    if args.json:
        print(json.dumps(entries, indent=2))
        return EXIT_OK
    if not entries:
        print(f"registry {registry.location}: no decisions recorded yet")
    for entry in entries:
        was = f" (production was {entry['previous']})" if entry.get("previous") else ""
        run = f", run {entry['run']}" if entry.get("run") else ""
        print(f"{entry['time']}  {entry['event']:<11} {entry['version']}{was}  by {entry['by']}{run}")
        print("\n".join(f"    {reason}" for reason in entry.get("reasons", [])))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
