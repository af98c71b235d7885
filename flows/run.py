"""`eagle3 run CONFIG [--set section.field=value ...] [--mode full|retrain|benchmark]`: the eagle3 flow run in this
process, on the Prefect API configured (PREFECT_API_URL) or else an ephemeral one, then a summary table.

Exit status: 0 promoted (or benchmark done), 3 rolled back, 1 failed.
"""

from __future__ import annotations

import sys

from flows.entry import config_parser

EXIT_PROMOTED, EXIT_FAILED, EXIT_ROLLED_BACK = 0, 1, 3


def main(argv: list[str] | None = None) -> int:
    parser = config_parser("eagle3 run", __doc__)
    parser.add_argument("--mode", choices=("full", "retrain", "benchmark"), default="full")
    args = parser.parse_args(argv)

    from eagle3.config import DEPLOYMENT_SECTIONS, check_local_inputs, load_config, require_sections
    from eagle3.errors import Eagle3Error
    from flows.eagle3 import eagle3, ensure_registry_limit
    from flows.summary import summary

    try:
        config = load_config(args.config, args.overrides)
        require_sections(config, DEPLOYMENT_SECTIONS, "eagle3 run (the whole pipeline)")
        check_local_inputs(config)  # before anything reaches Prefect: a missing path creates no flow run
    except Eagle3Error as err:
        print(f"eagle3 run: {err}", file=sys.stderr)
        return EXIT_FAILED
    ensure_registry_limit(args.config, args.overrides)
    state = eagle3(args.config, args.overrides, args.mode, return_state=True)
    print(summary(state, config, args.mode))
    if state.is_failed() or state.is_crashed() or state.is_cancelled():
        return EXIT_FAILED
    return EXIT_ROLLED_BACK if state.name == "RolledBack" else EXIT_PROMOTED


if __name__ == "__main__":
    sys.exit(main())
