"""The registry's lock for a flow run: the library's lock (eagle3/registry/lock.py, kept in the registry's own store)
with this flow run, its host and process and its Prefect API recorded as the holder."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from prefect.client.orchestration import get_client
from prefect.runtime import flow_run

from eagle3.config.deployment import RegistrySection
from eagle3.registry.lock import Holder, Lease, registry_lock
from eagle3.registry.registry import open_registry


@contextlib.contextmanager
def flow_run_lock(section: RegistrySection, log: Callable[[str], None]) -> Iterator[Lease]:
    with get_client(sync_client=True) as client:  # PREFECT_API_URL, or the temporary API Prefect started
        api = str(client.api_url)
    holder = Holder.here(str(flow_run.id), section.lock_lease_s, api=api)
    with registry_lock(open_registry(section, log=log), holder, log) as lease:
        yield lease
