"""`eagle3 registry unlock --config CONFIG [--set section.field=value ...] [--force]`: free the registry's lock by
hand, on the Prefect API configured (PREFECT_API_URL) or else a temporary one on PREFECT_HOME's database (the one
`eagle3 run` uses without PREFECT_API_URL). Says whose lock it was; the registry's history records it (unlocked).
A holder that still looks alive (its flow run running, its process alive, its record renewed) is left alone unless
--force.

Exit status: 0 freed (or nothing held it), 1 the holder looks alive (not freed without --force) or an error.
"""

from __future__ import annotations

import argparse
import sys

import flows.entry  # noqa: F401  (Prefect's start-up environment, set before Prefect loads)

EXIT_OK, EXIT_REFUSED = 0, 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eagle3 registry unlock", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="pipeline config (YAML)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    parser.add_argument("--force", action="store_true", help="free it even though its holder looks alive")
    args = parser.parse_args(argv)

    from eagle3.config import load_config, require_sections
    from eagle3.errors import Eagle3Error
    from eagle3.registry.lock import holder_gone, read_holder
    from eagle3.registry.registry import open_registry
    from flows.api import run_api

    try:
        config = load_config(args.config, args.overrides)
        require_sections(config, ("registry",), "eagle3 registry unlock")
        registry = open_registry(config.registry, log=lambda line: print(line, file=sys.stderr))
        holder, _ = read_holder(registry.store)
        with run_api():
            from tasks.lock import run_state, taken_slots, unlock
            from tasks.run import ensure_registry_limit

            limit = ensure_registry_limit(args.config, args.overrides)
            if taken_slots(limit) < 1 and holder is None:
                print(f"registry {registry.location}: not locked, nothing to free")
                return EXIT_OK
            alive = holder is not None and holder_gone(holder, run_state(holder.run)) is None
            if alive and not args.force:
                print(f"registry {registry.location}: held by {holder.describe()}, which looks alive; stop that run, "
                      "or free it anyway with --force", file=sys.stderr)
                return EXIT_REFUSED
            why = "freed by hand (eagle3 registry unlock" + (" --force, its holder looked alive)" if alive else ")")
            unlock(registry, limit, print, by="eagle3 registry unlock", reason=why)
    except Eagle3Error as err:
        print(f"eagle3 registry unlock: {err}", file=sys.stderr)
        return EXIT_REFUSED
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
