"""What the command-line entries of the flow share (`eagle3 run` in flows/run.py, `eagle3 monitor` in
flows/monitor.py). Imported before Prefect: the first start of an ephemeral API migrates its database (~30 s on 2 cores,
longer than Prefect's default start-up timeout), and there is no network for telemetry (docs/pipeline.md)."""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def config_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A parser of CONFIG [--set section.field=value ...]."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    return parser
