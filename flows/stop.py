"""What a stopped `eagle3 run` tells Prefect and its caller: the stage it stopped in, and the flow run's final state.

Prefect ends a flow run that a signal interrupts Crashed ("Execution was aborted by a termination signal"); the
message here says which signal, during which stage, and that a re-run resumes (finished stages come from the cache,
training from its last checkpoint)."""

from __future__ import annotations

import signal

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.client.schemas.sorting import TaskRunSort
from prefect.states import Crashed

BEFORE_ANY_STAGE = "start-up"  # no task run had started: the config, the Prefect API or the registry's lock


def stopped_stage(flow_run_id) -> str:
    """The name of the last task run that had started and not completed (task run names are `<task>-<suffix>`)."""
    if flow_run_id is None:
        return BEFORE_ANY_STAGE
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
                                     sort=TaskRunSort.EXPECTED_START_TIME_DESC)
    unfinished = [run for run in runs if run.start_time and not (run.state and run.state.is_completed())]
    return unfinished[0].name.rsplit("-", 1)[0] if unfinished else BEFORE_ANY_STAGE


def stop_message(signum: int, stage: str) -> str:
    return f"stopped by {signal.Signals(signum).name} during {stage}; a re-run resumes"


def mark_stopped(flow_run_id, message: str) -> None:
    """The flow run ends Crashed with `message`, whatever state the interrupted engine left (forced: it may have
    had no time to leave Running)."""
    if flow_run_id is None:
        return
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run_id, Crashed(message=message), force=True)
