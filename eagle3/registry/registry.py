"""The draft registry: immutable versions, one production pointer moved by compare-and-swap, a decision log.

Layout under the store's root (a directory, or a bucket prefix):
- `versions/<id>/<layout>/…` — the exported checkpoint directories, then `versions/<id>/manifest.json`, written
  last: a version exists (is listed) only once its manifest does, and the manifest lists every file with its
  size and sha256, so a fetch can check every byte.
- `production` — the pointer, JSON {version, previous, updated, event, reason}. It moves only through the
  store's conditional write: two promotions that read the same pointer cannot both win. Callers say which
  production version they decided against (`expected`); the etag check underneath makes that atomic. Its
  version is None after the first promotion was rolled back (there was no production version before).
- `history/<UTC time>-<uuid>.json` — one object per decision (promoted, rejected, rolled-back, forced, unlocked,
  taken-over),
  never rewritten.
- `lock.json` — the registry's lock: who holds it, and its lease (eagle3/registry/lock.py).
A promotion or rollback only moves the pointer: no version is ever deleted by it (docs/contracts.md).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import replace
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from eagle3 import guard
from eagle3.config.deployment import GateSection, RegistrySection
from eagle3.fsutil import atomic_directory, sha256_file
from eagle3.registry.gate import Decision, Metrics, decide, suite_figures, throughput_text
from eagle3.registry.s3 import S3Store
from eagle3.registry.store import LocalStore, PointerConflict, RegistryError, Store
from eagle3.shape import DraftShape

__all__ = ["PointerConflict", "Registry", "RegistryError", "check_version_id", "decide_against_production",
           "metrics_of", "open_registry", "registry_location"]

VERSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
VERSION_RULE = "1-128 letters, digits, '.', '_' or '-', starting with a letter or digit, with no '..'"
VERSIONS, HISTORY, POINTER, MANIFEST = "versions/", "history/", "production", "manifest.json"
EVENTS = ("promoted", "rejected", "rolled-back", "forced", "unlocked", "taken-over")  # the last two: registry/lock.py
RESERVED_FIELDS = ("version", "created", "layouts", "files")  # written by the registry itself
KNOWN_SHOWN = 8


def check_version_id(version_id: str, what: str = "version id") -> str:
    if not isinstance(version_id, str) or not VERSION_ID.fullmatch(version_id) or ".." in version_id:
        raise RegistryError(f"{what} {version_id!r} is not valid: use {VERSION_RULE}")
    return version_id


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


def version_run_dir(manifest: dict) -> str | None:
    """The run directory that trained a version (a contender's: the run's, whose data it trained on); None for a
    version whose manifest names none."""
    run = (manifest.get("config") or {}).get("run") or {}
    return run.get("data_from") or run.get("dir")


def version_algorithm(manifest: dict) -> str:
    """A version's draft algorithm, as the config that made it names it (EAGLE-3 before configs named one)."""
    return ((manifest.get("config") or {}).get("draft") or {}).get("algorithm", "eagle3")


def metrics_of(manifest: dict) -> Metrics:
    """The gate's view of a version: manifest["metrics"] = {"served": {accept_length, accept_rate, histogram,
    output_tokens_per_s, lost_requests, server_version}, "simulated": {accept_length}, "production": {speedup, ...},
    "engine_release"}, the shape production serves it with (manifest["serving"]), and the quality problems of its
    training data, manifest["data_quality"]["problems"]."""
    metrics = manifest.get("metrics") or {}
    served, simulated = metrics.get("served") or {}, metrics.get("simulated") or {}
    production = metrics.get("production") or {}  # the chosen serving shape's numbers; absent before sweeps
    chosen = {**production, "label": DraftShape.of(manifest["serving"]).label() if manifest.get("serving") else ""}
    return Metrics(
        accept_length=served.get("accept_length"),
        accept_rate=served.get("accept_rate"),
        simulated_accept_length=simulated.get("accept_length"),
        lost_requests=served.get("lost_requests") or 0,
        data_problems=tuple((manifest.get("data_quality") or {}).get("problems") or ()),
        speedup=production.get("speedup"),
        throughput=throughput_text(chosen),
        suites=suite_figures(served.get("suites")),
    )


def decide_against_production(registry: Registry, candidate: Metrics, production: str | None,
                              gate: GateSection, remeasured: dict | None = None) -> Decision:
    """The gate on `candidate` against the metrics recorded with the `production` version (None: none yet, a first
    deployment): one decision, whether the pipeline or a person through the CLI asks. `remeasured`: production
    measured on the candidate's own requests ({accept_length, suites}), which replaces the recorded figures (measured
    on other requests)."""
    recorded = metrics_of(registry.manifest(production)) if production else None
    if recorded is None or remeasured is None:
        return decide(candidate, recorded, gate)
    length = remeasured.get("accept_length")
    decision = decide(candidate, replace(recorded, accept_length=length, suites=suite_figures(remeasured.get("suites"))),
                      gate)
    decision.notes.append(f"production {production} measured on this run's prompts: accept length {fmt_length(length)} "
                          f"(recorded {fmt_length(recorded.accept_length)} on the prompts it was measured on)")
    return decision


def fmt_length(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


class Registry:
    def __init__(self, store: Store, log: Callable[[str], None] = print):
        self.store, self.log = store, log

    @property
    def location(self) -> str:
        return self.store.location

    # --- versions ------------------------------------------------------------------------------------------------

    def versions(self) -> list[str]:
        """Published versions, by id: those whose manifest exists (a partial upload has none)."""
        found = []
        for key in self.store.list(VERSIONS):
            parts = key.split("/")
            if len(parts) == 3 and parts[2] == MANIFEST:
                found.append(parts[1])
        return sorted(found)

    def _unknown(self, version: str) -> RegistryError:
        known = self.versions()
        if not known:
            return RegistryError(f"version {version!r} is not in the registry {self.location}: it has no versions yet")
        listed = ", ".join(known[-KNOWN_SHOWN:]) + (f" (and {len(known) - KNOWN_SHOWN} more)" if len(known) > KNOWN_SHOWN else "")
        return RegistryError(f"version {version!r} is not in the registry {self.location}; known versions: {listed}")

    def manifest(self, version: str) -> dict:
        check_version_id(version)
        key = f"{VERSIONS}{version}/{MANIFEST}"
        data, _ = self.store.read(key)
        if data is None:
            raise self._unknown(version)
        return self._parse(key, data)

    def _parse(self, key: str, data: bytes) -> dict:
        try:
            value = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise RegistryError(f"{self.location}/{key}: not valid JSON ({err}); restore it from a backup") from None
        if not isinstance(value, dict):
            raise RegistryError(f"{self.location}/{key}: expected a JSON object; restore it from a backup")
        return value

    def publish(self, version_id: str, dirs: dict[str, Path], manifest_fields: dict,
                progress: Callable[[int, int, str], None] | None = None) -> dict:
        """Upload `dirs` ({layout: directory}) as version `version_id`, each file verified, then the manifest.

        `progress(done, total, name)` is called after each verified file. On any failure the uploaded files are
        removed as far as the store allows and the error is re-raised; without a manifest they are never listed."""
        check_version_id(version_id)
        guard.require(f"publishing version {version_id}")
        reserved = sorted(set(manifest_fields) & set(RESERVED_FIELDS))
        if reserved:
            raise RegistryError(f"version {version_id}: the fields {reserved} are written by the registry; drop them")
        sources = files_to_publish(dirs)
        manifest_key = f"{VERSIONS}{version_id}/{MANIFEST}"
        if self.store.exists(manifest_key):
            raise RegistryError(
                f"version {version_id} already exists in {self.location}: versions are immutable; publish under a "
                "new version id")
        uploaded: list[str] = []
        try:
            files = {}
            for done, (name, path) in enumerate(sources, 1):
                key = f"{VERSIONS}{version_id}/{name}"
                uploaded.append(key)  # before the upload: a failed one may still leave an object behind
                digest = self.store.put_file(key, path)
                files[name] = {"bytes": digest.bytes, "sha256": digest.sha256}
                if progress is not None:
                    progress(done, len(sources), name)
            manifest = {
                **manifest_fields,
                "version": version_id,
                "created": utc_now().isoformat(timespec="seconds"),
                "layouts": sorted(dirs),
                "files": files,
            }
            data = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
            uploaded.insert(0, manifest_key)  # a failed write may still have landed: remove it too, first
            self.store.put_if(manifest_key, data, None)  # "must not exist": never replaces a visible version
        except PointerConflict:
            # Someone published the same id meanwhile: these files now belong to that version too, keep them.
            raise RegistryError(
                f"version {version_id} was published concurrently by another process; its files may have been "
                "overwritten by this upload (a fetch checks them against its manifest): use a new version id") from None
        except BaseException:
            self._remove_partial(version_id, uploaded)
            raise
        return manifest

    def _remove_partial(self, version_id: str, keys: list[str]) -> None:
        try:
            for key in keys:  # one at a time, in order: a manifest goes before the files it lists
                self.store.delete([key])
        except RegistryError as err:
            self.log(f"registry: could not remove the partial upload of {version_id} ({len(keys)} object(s) under "
                     f"{self.location}/{VERSIONS}{version_id}/): it is not listed without a manifest; {err}")

    def fetch(self, version: str, layout: str, dest: Path, overwrite: bool = False) -> Path:
        """Download one layout of a version into `dest`, every file checked against the manifest's sha256;
        `dest` appears only when complete. A `dest` that already holds exactly these files is kept; one that
        holds anything else is refused unless `overwrite`."""
        manifest = self.manifest(version)
        prefix = f"{layout}/"
        files = {name[len(prefix):]: entry for name, entry in manifest.get("files", {}).items() if name.startswith(prefix)}
        if not files:
            raise RegistryError(
                f"version {version} has no layout {layout!r}; it has: {', '.join(manifest.get('layouts', [])) or 'none'}")
        if not overwrite and holds_exactly(Path(dest), files):
            return Path(dest)  # fetched before and intact: serving the same version again reuses it
        with atomic_directory(Path(dest), overwrite=overwrite) as tmp:
            for relative, entry in sorted(files.items()):
                self.store.download(f"{VERSIONS}{version}/{layout}/{relative}", tmp / relative, entry["sha256"])
        return Path(dest)

    # --- the production pointer ------------------------------------------------------------------------------------

    def production(self) -> tuple[dict | None, str | None]:
        """The pointer and its etag; (None, None) before the first promotion. The pointer's version is None
        after a rollback of the first promotion (there was no production version before it)."""
        data, etag = self.store.read(POINTER)
        if data is None:
            return None, None
        return self._parse(POINTER, data), etag

    def production_version(self) -> str | None:
        pointer, _ = self.production()
        return pointer["version"] if pointer else None

    def require_production(self, version: str | None, when: str) -> None:
        """Raise unless production is `version` (None: no production version)."""
        now = self.production_version()
        if now != version:
            raise RegistryError(
                f"{when}: production in {self.location} is {now}, but should be {version} (a rollback did not take "
                f"effect); restore it with `eagle3 registry rollback --to {version}` and check `eagle3 registry history`"
                if version else f"{when}: production in {self.location} is {now}, but the run expected none")

    def promote(self, version: str, expected: str | None, reasons: list[str], by: str, run: str | None = None,
                event: str = "promoted", extra: dict | None = None) -> dict:
        """Point production at `version`, provided production is still `expected` (the version the caller
        decided against; None: there was none). Raises PointerConflict otherwise, or when another move lands
        between our read and our write. `event` is "promoted", or "forced" when a person overrides the gate.
        The version that was production stays in the registry."""
        if event not in ("promoted", "forced"):
            raise RegistryError(f"promote: event {event!r} is not one of promoted, forced")
        self.manifest(version)  # it must exist
        current, etag = self._production_as_expected(expected)
        return self._move(version, current, etag, reasons, by, run, event, extra)

    def rollback(self, reasons: list[str], by: str, to: str | None = None, run: str | None = None,
                 expected: str | None = None, extra: dict | None = None) -> dict:
        """Point production back where it was before its last move: the pointer's `previous` version (None if
        the last move was the first promotion: then no version is production), or at `to`. With `expected`,
        only if production is still that version."""
        current, etag = self.production()
        if current is None:
            raise RegistryError(f"registry {self.location} has no production pointer: there is nothing to roll back")
        if expected is not None and current["version"] != expected:
            raise self._conflict(current)
        if to is None and current.get("event") == "rolled-back":
            # its `previous` is the version that was rolled back (a rejected draft): never return to it unasked
            raise RegistryError(
                f"production {current['version']} in {self.location} was itself reached by rolling back "
                f"{current.get('previous')}; name the version to roll back to with --to VERSION (see history)")
        target = to or current.get("previous")
        if target is not None:
            self.manifest(target)
        return self._move(target, current, etag, reasons, by, run, "rolled-back", extra)

    def _production_as_expected(self, expected: str | None) -> tuple[dict | None, str | None]:
        """The pointer and its etag, provided production is still `expected`: fail before writing anything."""
        current, etag = self.production()
        if (current["version"] if current else None) != expected:
            raise self._conflict(current)
        return current, etag

    def _move(self, version: str | None, current: dict | None, etag: str | None, reasons: list[str], by: str,
              run: str | None, event: str, extra: dict | None) -> dict:
        """Write the pointer if it still has the `etag` it was read with: the store's compare-and-swap decides
        between concurrent moves."""
        if current is not None and current["version"] == version:
            raise RegistryError(f"version {version} is already production in {self.location}: nothing to do")
        guard.require(f"moving the production pointer to {version}")
        pointer = {
            "version": version,
            "previous": current["version"] if current else None,
            "updated": utc_now().isoformat(timespec="seconds"),
            "event": event,
            "reason": "; ".join(reasons) or event,
        }
        try:
            self.store.put_if(POINTER, (json.dumps(pointer, indent=2, sort_keys=True) + "\n").encode(), etag)
        except PointerConflict:
            raise self._conflict(self.production()[0]) from None
        try:
            self._write_history(event, version, pointer["previous"], reasons, by, run, extra)
        except RegistryError as err:
            # The pointer has moved and says why; a missing history entry must not turn a done promotion into
            # a reported failure (a caller would then roll back a healthy deployment).
            self.log(f"registry: production moved to {version} but its history entry could not be written: {err}")
        return pointer

    def _conflict(self, now: dict | None) -> PointerConflict:
        state = f"production is now {now['version']}" if now else "there is no production pointer"
        return PointerConflict(
            f"the production pointer in {self.location} is not what the caller read ({state}): another promotion "
            "or rollback came first; look at `eagle3 registry list` and decide again")

    # --- history ---------------------------------------------------------------------------------------------------

    def record(self, event: str, version: str | None, reasons: list[str], by: str, run: str | None = None,
               extra: dict | None = None) -> dict:
        """Log a decision that did not move the pointer, e.g. a rejected candidate (None: the run failed before
        it had a version). The entry's `previous` is production at the time."""
        if event not in EVENTS:
            raise RegistryError(f"history event {event!r} is not one of {', '.join(EVENTS)}")
        if version is not None:
            check_version_id(version)
        return self._write_history(event, version, self.production_version(), reasons, by, run, extra)

    def _write_history(self, event: str, version: str | None, previous: str | None, reasons: list[str], by: str,
                       run: str | None, extra: dict | None) -> dict:
        now = utc_now()
        entry = {"time": now.isoformat(timespec="microseconds"), "event": event, "version": version,
                 "previous": previous, "reasons": list(reasons), "by": by, "run": run, "extra": extra or {}}
        key = f"{HISTORY}{now.strftime('%Y%m%dT%H%M%S.%fZ')}-{uuid.uuid4().hex[:12]}.json"
        self.store.put_bytes(key, (json.dumps(entry, indent=2, sort_keys=True) + "\n").encode())
        return entry

    def history(self) -> list[dict]:
        """Every decision, oldest first."""
        entries = []
        for key in self.store.list(HISTORY):
            data, _ = self.store.read(key)
            if data is not None:  # listed, then read: nothing deletes history, but be exact about what was read
                entries.append((self._parse(key, data), key))
        return [entry for entry, _ in sorted(entries, key=lambda pair: (pair[0].get("time", ""), pair[1]))]


def files_to_publish(dirs: dict[str, Path]) -> list[tuple[str, Path]]:
    """(name under the version, local path) for every file of every layout directory, sorted."""
    if not dirs:
        raise RegistryError("publish: no directories given; pass {layout: directory}, e.g. {'sglang': export/sglang}")
    sources = []
    for layout, directory in sorted(dirs.items()):
        check_version_id(layout, "layout name")
        if layout == MANIFEST:
            raise RegistryError(f"layout name {layout!r} is the version's own manifest; choose another")
        directory = Path(directory)
        if not directory.is_dir():
            raise RegistryError(f"{directory}: not a directory (layout {layout}); export the checkpoint first")
        files = sorted(path for path in directory.rglob("*") if path.is_file())
        if not files:
            raise RegistryError(f"{directory}: empty (layout {layout}); export the checkpoint first")
        sources += [(f"{layout}/{path.relative_to(directory).as_posix()}", path) for path in files]
    return sources


def holds_exactly(directory: Path, files: dict[str, dict]) -> bool:
    """Whether `directory` holds these files (relative name -> {sha256}) and nothing else."""
    if not directory.is_dir():
        return False
    present = {path.relative_to(directory).as_posix(): path for path in directory.rglob("*") if path.is_file()}
    return present.keys() == files.keys() and all(
        sha256_file(present[name]) == entry["sha256"] for name, entry in files.items())


def registry_location(section: RegistrySection) -> str:
    """Where a config's registry lives, as one string (no I/O): an absolute directory, or s3://bucket/prefix
    with its endpoint when not AWS's."""
    if section.backend == "local":
        return str(Path(section.path).resolve())
    where = f"s3://{section.bucket}/{section.prefix.strip('/')}".rstrip("/")
    return f"{where} at {section.endpoint_url}" if section.endpoint_url else where


def open_registry(section: RegistrySection, log: Callable[[str], None] = print) -> Registry:
    """The registry a config names. An S3 store is first proven to honour conditional writes."""
    if section.backend == "local":
        return Registry(LocalStore(Path(section.path)), log)
    store = S3Store(section.bucket, section.prefix, section.endpoint_url)
    store.check_conditional_writes()
    return Registry(store, log)
