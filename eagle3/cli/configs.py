"""`eagle3 config | plan`: a pipeline config checked and resolved, whether each GPU stage fits its GPUs, and its hours."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from eagle3.cli.common import EXIT_OK, EXIT_PROBLEMS


def add_config_commands(commands) -> None:
    config = commands.add_parser("config", help="validate a pipeline config (and that it fits the GPUs); print it resolved")
    config.add_argument("path", type=Path)
    config.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    config.set_defaults(handler=run_config)

    plan = commands.add_parser("plan", help="per-GPU memory of every GPU stage against node.gpu_memory_gib (exit 1: "
                               "a stage does not fit), and the estimated hours of a first run's and a retrain's stages against "
                               "node.retrain_period_h (an estimate: it never changes the exit status)")
    plan.add_argument("path", type=Path)
    plan.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument("--nodes", type=node_count, default=None, metavar="N",
                      help="plan the hours on N nodes (default: training.nnodes, or the data.nodes count when more): "
                      "regeneration on every node's servers, "
                      "training across them (streamed: split between capture workers and trainers)")
    plan.add_argument("--capture-nodes", type=node_count, default=None, metavar="K",
                      help="training.features streamed: K of the N nodes run the capture workers, the others the "
                      "trainers (default: training.stream.capture_hosts' count on the config's own nodes, else the K "
                      "whose train stage is shortest)")
    plan.set_defaults(handler=run_plan)


def node_count(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: give a whole number of nodes, 1 or more")
    return int(value)


def run_config(args: argparse.Namespace) -> int:
    from eagle3.config import check_local_inputs
    from eagle3.resolve import load_config
    from eagle3.plan import require_fit

    config = load_config(args.path, args.overrides)
    check_local_inputs(config)
    require_fit(config, args.path)
    from eagle3.serving import serving_engine
    from eagle3.serving.base import launch_spec

    # the launcher's refusals now, not at a run's first launch
    serving_engine(config.serving.engine).check(launch_spec(config), config.production.telemetry, config.sweep)
    print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")
    return EXIT_OK


def run_plan(args: argparse.Namespace) -> int:
    from eagle3.resolve import load_config
    from eagle3.plan import plan_memory

    plan = plan_memory(load_config(args.path, args.overrides), args.nodes, args.capture_nodes)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print("\n".join(plan.table()))
    for refusal in plan.refusals():
        print(f"eagle3 plan: {args.path}: {refusal}", file=sys.stderr)
    return EXIT_OK if plan.all_fit else EXIT_PROBLEMS
