"""flows/setup.py, infra/setup.sh's Prefect side, on the session's Prefect server (the whole script runs in the
deployment e2e test): the work pools and the prefect file the deployments are made from."""

import uuid
from pathlib import Path

import pytest
import yaml
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate

from flows.setup import PROJECT_FILE, SetupError, deployments_file, ensure_work_pool


ROOT = Path(__file__).resolve().parent.parent


def test_a_pool_is_made_once_as_a_process_pool_of_one_and_another_type_is_refused(prefect_api):
    name, taken = f"pool-{uuid.uuid4().hex[:8]}", f"pool-{uuid.uuid4().hex[:8]}"
    with get_client(sync_client=True) as client:
        for _ in range(2):  # again: updated in place, not made twice
            ensure_work_pool(client, name)
        pool = client.read_work_pool(name)
        assert (pool.type, pool.concurrency_limit) == ("process", 1)
        assert "command" in pool.base_job_template["variables"]["properties"]  # the process worker's own template
        client.create_work_pool(WorkPoolCreate(name=taken, type="kubernetes"))
        with pytest.raises(SetupError, match=f"work pool '{taken}' exists with type 'kubernetes'; it must be 'process'"):
            ensure_work_pool(client, taken)


def test_the_deployments_take_the_config_and_overrides_from_a_copy_of_prefect_yaml(monkeypatch):
    monkeypatch.chdir(ROOT)
    spec = yaml.safe_load(PROJECT_FILE.read_text())
    default = spec["deployments"][0]["parameters"]["config"]
    assert deployments_file(default, [])[0] == PROJECT_FILE  # prefect.yaml as written

    path, names = deployments_file("configs/tiny-cpu.yaml", ["run.dir=/tmp/x"])
    try:
        copy = yaml.safe_load(path.read_text())
    finally:
        path.unlink()
    assert names == [d["name"] for d in spec["deployments"]] == ["full", "retrain", "benchmark", "monitor"]
    for written, deployment in zip(copy["deployments"], spec["deployments"]):
        assert written["parameters"] == {**deployment["parameters"], "config": "configs/tiny-cpu.yaml",
                                         "overrides": ["run.dir=/tmp/x"]}
        assert {k: v for k, v in written.items() if k != "parameters"} == \
            {k: v for k, v in deployment.items() if k != "parameters"}
    assert {k: v for k, v in copy.items() if k != "deployments"} == {k: v for k, v in spec.items() if k != "deployments"}
