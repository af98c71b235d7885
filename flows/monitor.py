"""`eagle3 monitor CONFIG [--set section.field=value ...]`: one window of production's acceptance, as the `eagle3`
flow's monitor mode in this process (on PREFECT_API_URL, or else an ephemeral API), then one line per verdict.

Exit status: 0 the window is ok, insufficient or unavailable; 4 it is low (an alarm raised or suppressed is said);
1 failed.
"""

from __future__ import annotations

import sys

from flows.entry import config_parser

EXIT_OK, EXIT_FAILED, EXIT_LOW = 0, 1, 4


def main(argv: list[str] | None = None) -> int:
    parser = config_parser("eagle3 monitor", __doc__)
    args = parser.parse_args(argv)

    from eagle3.config import require_sections
    from eagle3.resolve import load_config
    from eagle3.deployment.monitor import source_of
    from eagle3.errors import Eagle3Error
    from flows.eagle3 import eagle3

    try:  # a config the monitor cannot use creates no flow run
        config = load_config(args.config, args.overrides)
        require_sections(config, ("registry",), "eagle3 monitor")
        source_of(config.monitor, config.production)
    except Eagle3Error as err:
        print(f"eagle3 monitor: {err}", file=sys.stderr)
        return EXIT_FAILED
    state = eagle3(args.config, args.overrides, "monitor", return_state=True)
    if not state.is_completed():
        print(f"eagle3 monitor: {state.name}: {state.message}", file=sys.stderr)
        return EXIT_FAILED
    window = state.result()
    alarm = window.get("alarm") or {}
    print(f"{window['time']} production {window['version']}: {window['verdict']} - {window['reason']}"
          + (f"; alarm {alarm['state']}" + (f" ({alarm['note']})" if alarm.get("note") else "") if alarm else ""))
    return EXIT_LOW if window["verdict"] == "low" else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
