"""The production endpoint (docs/gpu-node.md), `managed` or `external`; every log line says which one is in effect.

managed:  the pipeline owns the production server. It stops it before the candidate needs the node, and then
          serves a registry version again - the promoted one, or on rejection / rollback the previous one - and
          re-measures it with the same benchmark as the candidate. The server outlives the run (its process
          group is recorded in state_dir/server.json) unless production.keep_serving is false, and, where systemd
          runs (production.supervisor), the worker too: it runs in a transient systemd scope of its own.
external: someone else runs production. The pipeline only moves the registry pointer and says what to restart.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from eagle3.config import PipelineConfig
from eagle3.resolve import derived, with_draft
from eagle3.deployment.promotion import (
    PROMPTS_FILE,
    PROMPTS_LAYOUT,
    benchmark_on,
    measure_server,
    prompt_ids_in,
    run_prompt_ids,
)
from eagle3.deployment.sweep import first_of_each_suite, with_shape
from eagle3.fsutil import atomic_write_json, read_json
from eagle3.procs import ProcessTree, group_alive
from eagle3.registry.registry import version_algorithm
from eagle3.procs import GPU_QUERY, STOP_GRACE_S, LaunchError, systemd_missing, wait_gpus_free
from eagle3.shape import DraftShape
from eagle3.serving import serving_engine
from eagle3.serving.base import launch_spec

Log = Callable[[str], None]
STATE_FILE = "server.json"


@dataclass(frozen=True)
class ProductionCheck:
    """Production after a run, or re-measured: the version it serves, its measurement (None: nothing measured) and
    the shortfall against the figures it was promoted on (None: it holds them)."""
    version: str | None
    measured: dict | None
    warning: str | None


class Production:
    def __init__(self, config: PipelineConfig, registry, log: Log = print):
        p = config.production
        self.config, self.registry, self.mode = config, registry, p.mode
        self.url = f"http://{p.host}:{p.port}"
        self.state = Path(p.state_dir) / STATE_FILE
        # the production server is the serving section's engine and launcher on the production endpoint
        self.serving_config = derived(config, {"serving.host": p.host, "serving.port": p.port})
        self._log = log

    def log(self, message: str) -> None:
        self._log(f"[production {self.mode} {self.url}] {message}")

    def release_node(self) -> None:
        """managed: stop the production server and wait for the GPUs' memory, so the run can have the node."""
        if self.mode == "external":
            self.log("external: left alone (it runs elsewhere)")
            return
        recorded = self.recorded()
        if recorded is None:
            self.log("no managed production server is running")
            return
        unit = f", systemd unit {recorded['unit']}" if recorded.get("unit") else ""
        self.log(f"stopping production (version {recorded['version']}, process group {recorded['pgid']}{unit})")
        ProcessTree.of_group(recorded["pgid"]).stop(grace_s=STOP_GRACE_S, log=self.log)
        self.state.unlink()
        s = self.config.serving
        wait_gpus_free(GPU_QUERY, s.gpu_free_mib, s.gpu_free_timeout_s, self.log)

    def serve(self, version: str | None, why: str) -> dict | None:
        """Serve `version` on the production endpoint and re-measure it; return the served result (None if external
        or there is no version)."""
        if self.mode == "external":
            self.log(f"external: registry production is {version} ({why}); restart the production server with "
                     f"that version's sglang export - the pipeline does not restart it")
            return None
        if version is None:
            self.release_node()  # e.g. a rejected first deployment that verify-production had started
            self.log(f"no production version in the registry ({why}): nothing to serve")
            return None
        # decided and fetched before the running server stops: a missing systemd that production.supervisor
        # requires, or an unreachable registry, must not leave production down
        keep = self.config.production.keep_serving
        unit = self.supervisor_unit() if keep else None
        draft = self.registry.fetch(version, "sglang", Path(self.config.production.state_dir) / "drafts" / version)
        config, prompts, temperature = self.measurement(version)
        self.release_node()
        self.log(f"serving version {version} ({why}) from {draft} ({config.serving.shape.label()}); "
                 f"{telemetry_note(self.config.production.telemetry)}")
        result = measure_server(launch_spec(config), config.benchmark, draft, prompts, self.log,
                                role=f"production {version}", keep_running=keep,
                                unit=unit, temperature=temperature, telemetry=self.config.production.telemetry)
        if keep:
            atomic_write_json(self.state, {"version": version, "pgid": result.pop("pgid"), "unit": unit,
                                           "url": self.url, "boot_id": boot_id(), "started": time.time()})
        else:
            self.log("stopped after the re-measure: production.keep_serving is false")
        return result

    def supervisor_unit(self) -> str | None:
        """The transient systemd scope the kept server runs in, so that a worker restart (systemd stops every
        process in the worker's cgroup; a new session is no new cgroup) leaves it running; None where it lives in
        the worker's process group."""
        p = self.config.production
        if p.supervisor == "none":
            self.log("production.supervisor is none: production lives in the worker's process group; a worker "
                     "restart stops it")
            return None
        missing = systemd_missing()
        if missing is None:
            unit = f"eagle3-production-{p.port}.scope"
            launcher = self.config.serving.launcher
            held = "" if launcher == "local" else f" (the local {launcher} process that holds the server on the node)"
            self.log(f"production runs in systemd unit {unit}{held}: a worker restart leaves it running")
            return unit
        if p.supervisor == "systemd":
            raise LaunchError(f"production.supervisor is systemd, but {missing}; fix that, or set "
                              "production.supervisor to auto or none (production then stops when the worker restarts)")
        self.log(f"no systemd here ({missing}): production lives in the worker's process group; a worker restart "
                 "stops it")
        return None

    def remeasure(self, version: str | None) -> dict | None:
        """Measure production as it is meant to serve: managed - served again from the registry; external - where
        it runs."""
        if self.mode == "managed":
            return self.serve(version, "re-measure")
        self.log(f"external: measuring it where it serves (registry production is {version})")
        if version is None:
            return None
        config, prompts, temperature = self.measurement(version)
        return benchmark_on(config.benchmark, serving_engine(config.serving.engine), self.url, prompts, self._log,
                            temperature=temperature)

    def measurement(self, version: str) -> tuple[PipelineConfig, list[list[int]], float]:
        """The config, prompts and temperature a version is served and re-measured with: the serving shape,
        concurrency, temperature and prompts it was chosen with (the first `num_prompts` requests of each suite; older
        versions: this config's shape, greedy, every prompt), from the prompt set and max_new_tokens it was measured on
        when published, so its recorded accept length is comparable (a retrain's new prompts cannot fake a
        shortfall). A version published before versions recorded their prompts is measured on this run's."""
        manifest = self.registry.manifest(version)
        config, temperature, count = of_kind(self.serving_config, manifest), 0.0, None
        if manifest.get("serving"):
            serving = manifest["serving"]
            shaped = with_shape(config, DraftShape.of(serving))
            config = derived(shaped, {"benchmark.concurrency": [serving["concurrency"]]})
            temperature, count = serving["temperature"], serving["num_prompts"]
        recorded = manifest.get("benchmark")
        if recorded is None:
            self.log(f"version {version} records no prompt set (published before versions kept theirs): measured on "
                     "this run's held-out prompts, so a shortfall may come from other prompts")
            prompts = run_prompt_ids(config.benchmark, config.data, config.run, config.target)
            return config, first_of_each_suite(prompts, count), temperature
        fetched = self.registry.fetch(version, PROMPTS_LAYOUT,
                                      Path(self.config.production.state_dir) / "prompts" / version)
        config = derived(config, {"benchmark.max_new_tokens": recorded["max_new_tokens"]})
        prompts = first_of_each_suite(prompt_ids_in(config.data, config.target, fetched / PROMPTS_FILE), count)
        self.log(f"measured on version {version}'s own prompt set: {len(prompts)} of its {recorded['prompts']} prompts "
                 f"(sha256 {recorded['sha256'][:12]}), max_new_tokens {recorded['max_new_tokens']}, temperature "
                 f"{temperature}, {config.benchmark.production_concurrency} concurrent")
        return config, prompts, temperature

    def recorded(self) -> dict | None:
        if not self.state.is_file():
            return None
        recorded = read_json(self.state, "")
        if recorded.get("boot_id") != boot_id():  # the machine restarted: that process id may be anyone's now
            self.log(f"the recorded server (process group {recorded['pgid']}) ran before the last reboot: forgotten")
            self.state.unlink()
            return None
        if not group_alive(recorded["pgid"]):
            self.log(f"the recorded server (process group {recorded['pgid']}) is no longer running")
            self.state.unlink()
            return None
        return recorded

    def check(self, version: str | None, measured: dict | None, tolerance: float) -> str | None:
        """A loud warning when production no longer reaches its recorded accept length; None when it does."""
        if version is None or measured is None:
            return None
        metrics = self.registry.manifest(version).get("metrics") or {}
        # the chosen shape's numbers, which production is served with; before sweeps, the candidate's measurement
        recorded = (metrics.get("production") or metrics.get("served") or {}).get("accept_length")
        now = measured.get("accept_length")
        if recorded is None:
            return None
        if now is None or now < recorded * (1 - tolerance):
            warning = (f"PRODUCTION SHORTFALL: version {version} now measures accept length {now} against its "
                       f"recorded {recorded:.3f} (tolerance {tolerance:.0%}): the target, the server or the prompts "
                       "changed since it was promoted; investigate before the next promotion")
            self.log(warning)
            return warning
        self.log(f"version {version} measures accept length {now:.3f}, recorded {recorded:.3f}: as promoted")
        return None

    def checked(self, version: str | None, measured: dict | None) -> ProductionCheck:
        return ProductionCheck(version, measured, self.check(version, measured, self.config.gate.production_tolerance))


def of_kind(config: PipelineConfig, manifest: dict) -> PipelineConfig:
    """`config` for serving a version of another draft algorithm than its own (a rollback across algorithms): the
    version's draft.algorithm and its own fields, so its recorded serving shape is checked against its kind (the
    launcher serves a draft by its own kind already), and no sweep points (they are the run's kind's shapes; production
    is measured in the version's one)."""
    if version_algorithm(manifest) == config.draft.algorithm:
        return config
    return with_draft(config, manifest["config"]["draft"])


def boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def telemetry_note(telemetry) -> str:
    """What production reports about its traffic (production.telemetry), for the log line that starts it."""
    parts = (["/metrics on"] if telemetry.metrics else []) + (
        [f"request records to {telemetry.records_dir}"] if telemetry.records_dir is not None else [])
    return f"telemetry: {', '.join(parts)}" if parts else "telemetry off (production.telemetry)"
