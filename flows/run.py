"""`eagle3 run CONFIG [--set section.field=value ...] [--mode full|retrain|benchmark]`: the eagle3 flow run in this
process, on the Prefect API configured (PREFECT_API_URL) or else a temporary one of its own (flows/api.py), then a
summary table.

Exit status: 0 promoted (or benchmark done), 3 rolled back, 1 failed, 4 lost the registry's lock (another run took it
over: this one stopped before its next side effect, with the last line "eagle3 run: lost the registry's lock: ...");
stopped by a signal: 128 + its number (143
SIGTERM, 130 SIGINT), after the run released what it held (the registry's lock, the servers and trainers it started,
its temporary Prefect API), with the last line "eagle3 run: stopped by SIGTERM during <stage>; a re-run resumes".
"""

from __future__ import annotations

import signal
import sys

from flows.entry import config_parser

EXIT_PROMOTED, EXIT_FAILED, EXIT_ROLLED_BACK, EXIT_LOCK_LOST = 0, 1, 3, 4


def main(argv: list[str] | None = None) -> int:
    parser = config_parser("eagle3 run", __doc__)
    parser.add_argument("--mode", choices=("full", "retrain", "benchmark"), default="full")
    args = parser.parse_args(argv)

    from eagle3.algorithms import require_deployable
    from eagle3.config import DEPLOYMENT_SECTIONS, check_local_inputs, require_sections
    from eagle3.resolve import draft_configs, load_config
    from eagle3.errors import Eagle3Error
    from eagle3.procs import Terminated, terminate_on_sigterm
    from flows.api import run_api

    try:
        config = load_config(args.config, args.overrides)
        require_sections(config, DEPLOYMENT_SECTIONS, "eagle3 run (the whole pipeline)")
        for label, draft in draft_configs(config).items():  # the run's draft and each contender
            require_deployable(draft.draft.algorithm, f"eagle3 run (the whole pipeline), draft {label}")
        check_local_inputs(config)  # before anything reaches Prefect: a missing path creates no flow run
    except Eagle3Error as err:
        print(f"eagle3 run: {err}", file=sys.stderr)
        return EXIT_FAILED
    started = {}  # the flow run's id, once Prefect has one
    # a SIGTERM raises Terminated (SystemExit) instead of ending the process on the spot; within the flow run
    # Prefect's own handler takes it first, marks the run Crashed and sends it again, which lands here once the run
    # has unwound (its lock released, its trainers and servers stopped) and the API is still up
    with terminate_on_sigterm():
        try:
            with run_api() as private_url:
                try:
                    return run_flow(args, config, started, private_api=private_url is not None)
                except (Terminated, KeyboardInterrupt) as stop:
                    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
                    signum = signal_of(stop)
                    message = tell_prefect(signum, started.get("id"))
        except (Terminated, KeyboardInterrupt) as stop:  # before any flow run: nothing to tell Prefect
            from flows.stop import BEFORE_ANY_STAGE, stop_message

            signum = signal_of(stop)
            message = stop_message(signum, BEFORE_ANY_STAGE)
    print(f"eagle3 run: {message}", file=sys.stderr, flush=True)  # the last line, after the API's stop
    return 128 + signum


def signal_of(stop: BaseException) -> int:
    return signal.SIGINT if isinstance(stop, KeyboardInterrupt) else stop.code - 128


def run_flow(args, config, started: dict, private_api: bool) -> int:
    from eagle3.guard import LockLost
    from flows.eagle3 import eagle3
    from flows.summary import summary

    flow = eagle3.with_options(on_running=[lambda _flow, run, _state: started.update(id=run.id)])
    state = flow(args.config, args.overrides, args.mode, return_state=True)
    print(summary(state, config, args.mode, private_api))
    if state.is_failed() and isinstance(lost := state.result(raise_on_failure=False), LockLost):
        print(f"eagle3 run: {lost}", file=sys.stderr, flush=True)
        return EXIT_LOCK_LOST
    if state.is_failed() or state.is_crashed() or state.is_cancelled():
        return EXIT_FAILED
    return EXIT_ROLLED_BACK if state.name == "RolledBack" else EXIT_PROMOTED


def tell_prefect(signum: int, flow_run_id) -> str:
    """The run's final state says where it stopped (its queued logs reach the API before it stops: flows/api.py)."""
    from flows.stop import mark_stopped, stop_message, stopped_stage

    message = stop_message(signum, stopped_stage(flow_run_id))
    mark_stopped(flow_run_id, message)
    return message


if __name__ == "__main__":
    sys.exit(main())
