"""`python -m flows.setup CONFIG [--set section.field=value ...]`: the Prefect side of infra/setup.sh, in one process.

On the server PREFECT_API_URL names (the script checks it answers): the work pools and the
prefect file the deployments are made from. Prints three lines for the script (the registry's event resource,
the prefect file, the deployments' names) and says what it did on stderr. Exit status 1 with one line on a fault.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import httpx
import yaml

import flows.entry  # noqa: F401  (Prefect's start-up environment, set before Prefect loads)

PROJECT_FILE = Path("prefect.yaml")  # in the checkout, the script's working directory
# gpu-node: the node holds one target at a time; eagle3-monitor: the monitor never queues behind a GPU run, and its
# windows form a streak. Each runs one flow run at a time.
WORK_POOLS = ("gpu-node", "eagle3-monitor")


class SetupError(Exception):
    pass


def say(line: str) -> None:
    print(line, file=sys.stderr)


def require_server() -> str:
    """The API URL, once a server answers there: without one every Prefect call would use a throwaway database."""
    from prefect.settings import get_current_settings

    url = get_current_settings().api.url or ""
    if not url:
        raise SetupError("PREFECT_API_URL is not set: export PREFECT_API_URL=http://SERVER:4200/api (see "
                         "infra/README.md)")
    try:
        healthy = httpx.get(url.rstrip("/") + "/health", timeout=10).status_code == 200
    except httpx.HTTPError as err:
        healthy, url = False, f"{url} ({type(err).__name__}: {err})"
    if not healthy:
        raise SetupError(f"no Prefect server answers at {url} (is `prefect server start` running?)")
    return url


def ensure_work_pool(client, name: str) -> None:
    """A process pool running one flow run at a time; an existing pool of another type is an error, not replaced."""
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker

    try:
        pool = client.read_work_pool(name)
    except ObjectNotFound:
        client.create_work_pool(WorkPoolCreate(name=name, type="process", concurrency_limit=1,
                                               base_job_template=ProcessWorker.get_default_base_job_template()))
        say(f"Work pool '{name}' (process, one flow run at a time) created.")
        return
    if pool.type != "process":
        raise SetupError(f"work pool '{name}' exists with type '{pool.type}'; it must be 'process' (delete it first)")
    client.update_work_pool(name, WorkPoolUpdate(concurrency_limit=1))
    say(f"Work pool '{name}' (process) exists; one flow run at a time.")


def deployments_file(config: str, overrides: list[str]) -> tuple[Path, list[str]]:
    """prefect.yaml itself when CONFIG and no overrides are its default, else a copy whose deployments default to
    them (`prefect deploy --all` takes no parameters from its command line). With the deployments' names."""
    spec = yaml.safe_load(PROJECT_FILE.read_text())
    names = [d["name"] for d in spec["deployments"]]
    defaults = {d["parameters"]["config"] for d in spec["deployments"]}
    if len(defaults) != 1:
        raise SetupError(f"prefect.yaml: the deployments disagree on the default config: {sorted(defaults)}")
    if defaults == {config} and not overrides:
        return PROJECT_FILE, names
    for deployment in spec["deployments"]:
        deployment["parameters"].update(config=config, overrides=list(overrides))
    with tempfile.NamedTemporaryFile("w", prefix="eagle3-deployments-", suffix=".yaml", delete=False) as out:
        yaml.safe_dump(spec, out, sort_keys=False)
    return Path(out.name), names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.setup", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="pipeline config (YAML) the deployments run by default")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    args = parser.parse_args(argv)

    from prefect.client.orchestration import get_client

    from eagle3.resolve import load_config
    from tasks.run import registry_resource

    try:
        say(f"Prefect server: {require_server()}")
        with get_client(sync_client=True) as client:
            for pool in WORK_POOLS:
                ensure_work_pool(client, pool)
        # the monitor emits on the registry's event resource; the retrain's trigger (prefect.yaml) matches it
        resource = registry_resource(load_config(args.config, args.overrides).registry)
        say(f"Registry event resource: {resource}")
        path, names = deployments_file(args.config, args.overrides)
    except SetupError as err:
        print(f"infra/setup.sh: {err}", file=sys.stderr)
        return 1
    print(resource)
    print(path)
    print(" ".join(names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
