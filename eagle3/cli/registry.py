"""`eagle3 registry …`: read the registry a config names, and move its production pointer by hand."""

from __future__ import annotations

import argparse
import json
import sys

from eagle3.cli.common import EXIT_OK, EXIT_PROBLEMS, add_config_arguments, load_run_config


def add_registry_commands(commands) -> None:
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
    imported = add_config_arguments(registry_commands.add_parser(
        "import", help="a draft trained elsewhere (SpecForge/SGLang, speculators or native layout) as a version: "
        "validated for the config's target and release, converted to the sglang layout, with its provenance"))
    imported.add_argument("source", metavar="DIR|HUB_ID",
                          help="the draft's directory; a hub id (owner/name) is fetched on the node (huggingface_hub)")
    imported.add_argument("--as-production", action="store_true",
                          help="measure it on the run's benchmark prompts and make it production, re-measured there "
                          "as after a promotion (rolled back if that fails)")
    imported.set_defaults(handler=run_registry_import)
    unlock = add_config_arguments(registry_commands.add_parser(
        "unlock", help="free the registry's lock left by a run that is gone; says whose it was (history: unlocked)"))
    unlock.add_argument("--force", action="store_true", help="free it even though its holder looks alive")
    unlock.set_defaults(handler=run_registry_unlock)


def run_registry_unlock(args: argparse.Namespace) -> int:
    """Free the registry's lock by hand (its record, in the registry's store); a holder that looks alive only with
    --force. Exit 0 freed or not held, 1 refused."""
    from eagle3.registry.lock import looks_alive, read_holder, unlock
    from eagle3.registry.store import PointerConflict

    _, registry = open_config_registry(args)
    holder, _ = read_holder(registry.store)
    if holder is None:
        print(f"registry {registry.location}: not locked, nothing to free")
        return EXIT_OK
    alive = looks_alive(holder)
    if alive and not args.force:
        print(f"registry {registry.location}: held by {holder.describe()}, which looks alive (renewed "
              f"{holder.renewed}, lease {holder.lease_s:.0f} s); stop that run, or free it anyway with --force",
              file=sys.stderr)
        return EXIT_PROBLEMS
    why = "freed by hand (eagle3 registry unlock" + (" --force, its holder looked alive)" if alive else ")")
    try:
        freed = unlock(registry, by="eagle3 registry unlock", reason=why)
    except PointerConflict:
        print(f"registry {registry.location}: its lock changed hands while this ran; look again", file=sys.stderr)
        return EXIT_PROBLEMS
    print(f"registry {registry.location}: freed the lock of {freed.describe() if freed else 'nobody'}: {why}")
    return EXIT_OK


def open_config_registry(args: argparse.Namespace):
    from eagle3.registry.registry import open_registry

    config = load_run_config(args, needs=("registry",))
    return config, open_registry(config.registry, log=lambda line: print(line, file=sys.stderr))


def describe_served(manifest: dict) -> str:
    served = (manifest.get("metrics") or {}).get("served") or {}
    shown = {name: "n/a" if served.get(name) is None else f"{served[name]:.3f}" for name in ("accept_length", "accept_rate")}
    return f"served accept length {shown['accept_length']}, accept rate {shown['accept_rate']}"


def run_registry_list(args: argparse.Namespace) -> int:
    from eagle3.registry.registry import version_algorithm

    _, registry = open_config_registry(args)
    pointer, _ = registry.production()
    production = pointer["version"] if pointer else None
    manifests = sorted((registry.manifest(v) for v in registry.versions()), key=lambda m: (m.get("created", ""), m["version"]))
    previous = f" (previous: {pointer['previous']})" if pointer and pointer.get("previous") else ""
    print(f"registry {registry.location}: {len(manifests)} version(s), production: {production or 'none'}{previous}")
    for manifest in manifests:
        mark = "*" if manifest["version"] == production else " "
        print(f"{mark} {manifest['version']}  {manifest.get('created', '?')}  {version_algorithm(manifest)}  "
              f"{describe_served(manifest)}")
    return EXIT_OK


def run_registry_show(args: argparse.Namespace) -> int:
    from eagle3.registry.registry import metrics_of, version_algorithm
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
    print(f"version: {manifest['version']}{role}, draft.algorithm {version_algorithm(manifest)}")
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
    if candidate.get("metrics") is None:  # an import without --as-production: never measured
        reasons = [f"unmeasured: {args.version} holds no figures (imported without --as-production): the gate cannot "
                   "judge it; forced, the next run measures it on that run's prompts"]
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


def run_registry_import(args: argparse.Namespace) -> int:
    """A refusal is one line naming the problem by its code (exit 1); nothing is published then."""
    from eagle3.deployment.imports import ProductionRefused, import_draft
    from eagle3.validation.external import ImportRefused

    config = load_run_config(args)  # the sections it needs: import_draft says which are missing
    try:
        result = import_draft(config, args.source, args.as_production, log=lambda line: print(line, file=sys.stderr))
    except (ImportRefused, ProductionRefused) as err:
        print(f"eagle3: {err}", file=sys.stderr)
        return EXIT_PROBLEMS
    news = "published" if result["published"] else "already in the registry, nothing published"
    print(f"{args.source}: version {result['version']} ({result['layout_found']} layout found; {news})")
    production = result["production"]
    if production is not None:
        measured = production["measured"]
        figure = f", re-measured accept length {measured['accept_length']:.3f}" if measured else ""
        print(f"production: {result['version']} (was {production['previous'] or 'unset'}){figure}")
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
