"""The draft registry on both backends: a local directory, and S3 served by moto over real HTTP on 127.0.0.1."""

import json
import threading
from pathlib import Path

import boto3
import pytest
from s3_server import MotoServer, S3Proxy, new_bucket

from eagle3.cli import main
from eagle3.resolve import load_config
from eagle3.config.deployment import GateSection, RegistrySection
from eagle3.registry.gate import Metrics
from eagle3.registry.registry import (
    PointerConflict,
    RegistryError,
    decide_against_production,
    metrics_of,
    open_registry,
    registry_location,
)
from helpers import PREFIX, TINY, fields, write_checkpoint


def tree(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture
def registry(section):
    return open_registry(section, log=lambda line: None)


@pytest.fixture
def exports(tmp_path) -> dict[str, dict[str, Path]]:
    """Three versions' export directories, each with an sglang and a speculators layout."""
    return {
        version: {layout: write_checkpoint(tmp_path / "exports" / version / layout, seed)
                  for layout, seed in (("sglang", index * 2), ("speculators", index * 2 + 1))}
        for index, version in enumerate(("v1", "v2", "v3"))
    }


def test_publish_list_show_fetch_round_trip(registry, exports, tmp_path):
    seen = []
    manifest = registry.publish("v1", exports["v1"], fields(), progress=lambda done, total, name: seen.append((done, total)))
    assert registry.versions() == ["v1"]
    assert seen[-1] == (6, 6)
    stored = registry.manifest("v1")
    assert stored == manifest
    assert stored["version"] == "v1" and stored["layouts"] == ["sglang", "speculators"]
    assert stored["metrics"] == fields()["metrics"] and stored["lineage"] == {"parent": None, "run": "run-1"}
    assert set(stored["files"]) == {f"{layout}/{name}" for layout in ("sglang", "speculators")
                                    for name in ("config.json", "model.safetensors", "shards/extra.bin")}
    assert stored["files"]["sglang/model.safetensors"]["bytes"] == 50_000
    for layout in ("sglang", "speculators"):
        fetched = registry.fetch("v1", layout, tmp_path / "fetched" / layout)
        assert tree(fetched) == tree(exports["v1"][layout])  # bit-identical
    with pytest.raises(RegistryError, match="no layout 'native'.*sglang, speculators"):
        registry.fetch("v1", "native", tmp_path / "fetched" / "native")
    again = registry.fetch("v1", "sglang", tmp_path / "fetched" / "sglang")  # already there and intact: kept
    assert tree(again) == tree(exports["v1"]["sglang"])
    (again / "config.json").write_text("{}")
    with pytest.raises(FileExistsError, match="already exists"):
        registry.fetch("v1", "sglang", again)
    assert tree(registry.fetch("v1", "sglang", again, overwrite=True)) == tree(exports["v1"]["sglang"])


def test_bad_version_ids_are_refused(registry, exports):
    for bad in ["../x", "a/b", "", ".hidden", "a..b", "v1\n", "x" * 129]:
        with pytest.raises(RegistryError, match=r"version id .* is not valid: use 1-128 letters"):
            registry.publish(bad, exports["v1"], fields())
        with pytest.raises(RegistryError, match="is not valid"):
            registry.manifest(bad)
    with pytest.raises(RegistryError, match="layout name '../up' is not valid"):
        registry.publish("v1", {"../up": exports["v1"]["sglang"]}, fields())
    assert registry.versions() == []


def test_duplicate_version_and_reserved_fields_are_refused(registry, exports):
    first = registry.publish("v1", exports["v1"], fields())
    with pytest.raises(RegistryError, match="v1 already exists.*immutable"):
        registry.publish("v1", exports["v2"], fields(accept_length=9.0))
    with pytest.raises(RegistryError, match=r"\['files', 'version'\] are written by the registry"):
        registry.publish("v2", exports["v2"], {"version": "x", "files": {}})
    assert registry.manifest("v1") == first and registry.versions() == ["v1"]


def test_unknown_version_names_the_known_ones(registry, exports):
    with pytest.raises(RegistryError, match="'v9' is not in the registry .* no versions yet"):
        registry.manifest("v9")
    registry.publish("v1", exports["v1"], fields())
    registry.publish("v2", exports["v2"], fields())
    with pytest.raises(RegistryError, match="'v9' is not in the registry .*known versions: v1, v2"):
        registry.promote("v9", None, ["test"], by="pipeline")


def test_promote_keeps_previous_and_rollback_restores_it(registry, exports, tmp_path):
    registry.publish("v1", exports["v1"], fields())
    registry.publish("v2", exports["v2"], fields(parent="v1"))
    assert registry.production() == (None, None)

    first = registry.promote("v1", None, ["gate passed"], by="pipeline", run="run-1")
    assert (first["version"], first["previous"], first["reason"]) == ("v1", None, "gate passed")
    assert registry.production()[0] == first
    second = registry.promote("v2", "v1", ["gate passed"], by="pipeline", run="run-2")
    assert (second["version"], second["previous"]) == ("v2", "v1")

    # promotion never deletes: the previous version is still listed and fetches bit-identically
    assert registry.versions() == ["v1", "v2"]
    assert tree(registry.fetch("v1", "sglang", tmp_path / "old")) == tree(exports["v1"]["sglang"])

    registry.record("rejected", "v2", ["regression: accept length fell"], by="pipeline", run="run-3")
    back = registry.rollback(["served accept length regressed after restart"], by="cli", expected="v2")
    assert (back["version"], back["previous"], back["event"]) == ("v1", "v2", "rolled-back")
    assert registry.production()[0] == back
    with pytest.raises(RegistryError, match="itself reached by rolling back v2; name the version"):
        registry.rollback(["again"], by="cli")  # never back to the rejected v2 without naming it
    with pytest.raises(RegistryError, match="already production"):
        registry.promote("v1", "v1", ["again"], by="cli")

    events = [(e["event"], e["version"], e["previous"], e["by"]) for e in registry.history()]
    assert events == [("promoted", "v1", None, "pipeline"), ("promoted", "v2", "v1", "pipeline"),
                      ("rejected", "v2", "v2", "pipeline"), ("rolled-back", "v1", "v2", "cli")]
    assert registry.history()[0]["run"] == "run-1"


def test_rolling_back_the_first_promotion_leaves_no_production_version(registry, exports):
    with pytest.raises(RegistryError, match="no production pointer"):
        registry.rollback(["why"], by="pipeline")
    registry.publish("v1", exports["v1"], fields())
    registry.publish("v2", exports["v2"], fields())
    registry.promote("v1", None, ["first"], by="pipeline")
    with pytest.raises(PointerConflict, match="production is now v1"):
        registry.rollback(["why"], by="pipeline", expected="v2")
    withdrawn = registry.rollback(["v1 failed its production check"], by="pipeline")
    assert (withdrawn["version"], withdrawn["previous"]) == (None, "v1")
    assert registry.production_version() is None and registry.versions() == ["v1", "v2"]
    assert registry.promote("v2", None, ["gate passed"], by="pipeline")["previous"] is None
    assert registry.rollback(["by hand"], by="cli", to="v1")["version"] == "v1"
    record = registry.record("rejected", None, ["the run failed before export"], by="pipeline")
    assert (record["version"], record["previous"]) == (None, "v1")


class RaceAtThePointer:
    """The registry's store, except that each write of the pointer waits until every racer has reached it: both
    promotions have read the same pointer and passed the registry's own early check, so only the store's
    compare-and-swap can decide."""

    def __init__(self, store, barrier: threading.Barrier):
        self.store, self.barrier = store, barrier

    def put_if(self, key, data, expected_etag):
        if key == "production":
            self.barrier.wait(timeout=20)
        return self.store.put_if(key, data, expected_etag)

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_concurrent_promotions_exactly_one_wins(section, registry, exports):
    """Two Registry objects, each with its own store client (as two runs have), and no registry lock: the pointer's
    compare-and-swap alone decides."""
    for version in ("v1", "v2", "v3"):
        registry.publish(version, exports[version], fields())
    registry.promote("v1", None, ["first"], by="pipeline")
    barrier = threading.Barrier(2)
    racers = {version: open_registry(section, log=lambda line: None) for version in ("v2", "v3")}
    for racer in racers.values():
        racer.store = RaceAtThePointer(racer.store, barrier)
    results: dict[str, object] = {}

    def promote(version: str) -> None:
        try:
            results[version] = racers[version].promote(version, "v1", ["gate passed"], by="pipeline")
        except PointerConflict as err:
            results[version] = err

    threads = [threading.Thread(target=promote, args=(version,)) for version in racers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    winners = [v for v, result in results.items() if isinstance(result, dict)]
    losers = [v for v, result in results.items() if isinstance(result, PointerConflict)]
    assert len(winners) == 1 and len(losers) == 1, results
    pointer, _ = registry.production()
    assert pointer["version"] == winners[0] and pointer["previous"] == "v1"
    assert f"production is now {winners[0]}" in str(results[losers[0]])
    assert [e["version"] for e in registry.history()] == ["v1", winners[0]]  # the loser left no trace


def test_a_stale_expectation_is_a_conflict(registry, exports):
    registry.publish("v1", exports["v1"], fields())
    registry.publish("v2", exports["v2"], fields())
    with pytest.raises(PointerConflict, match="there is no production pointer"):
        registry.promote("v1", "v2", ["x"], by="cli")
    registry.promote("v1", None, ["first"], by="pipeline")
    with pytest.raises(PointerConflict, match="production is now v1"):
        registry.promote("v2", None, ["x"], by="cli")  # it decided when there was no production version


def test_fetch_refuses_a_corrupted_object(registry, exports, tmp_path):
    registry.publish("v1", exports["v1"], fields())
    registry.store.put_bytes("versions/v1/sglang/model.safetensors", b"not the weights")  # damage at rest
    with pytest.raises(RegistryError, match="sha256 .* the manifest says .* corrupt"):
        registry.fetch("v1", "sglang", tmp_path / "fetched")
    assert not (tmp_path / "fetched").exists()  # no partial directory


def test_failed_local_publish_leaves_no_version(tmp_path, exports):
    registry = open_registry(RegistrySection(backend="local", path=tmp_path / "registry"), log=lambda line: None)
    registry.publish("v1", exports["v1"], fields())

    def crash(done, total, name):
        if done == 2:
            raise RuntimeError("disk full (simulated)")

    with pytest.raises(RuntimeError, match="simulated"):
        registry.publish("v2", exports["v2"], fields(), progress=crash)
    assert registry.versions() == ["v1"]
    assert not (tmp_path / "registry" / "versions" / "v2").exists()  # the partial files were removed
    registry.publish("v2", exports["v2"], fields())  # and the id is free for a clean retry
    assert registry.versions() == ["v1", "v2"]


def test_s3_outage_mid_upload_leaves_no_version(moto_s3, exports, tmp_path):
    bucket = new_bucket(moto_s3.url)
    section = RegistrySection(backend="s3", bucket=bucket, prefix=PREFIX, endpoint_url=moto_s3.url)
    logged = []
    registry = open_registry(section, log=logged.append)
    registry.publish("v1", exports["v1"], fields())
    registry.promote("v1", None, ["first"], by="pipeline")
    _, etag = registry.production()

    def outage(done, total, name):
        if done == 1:
            moto_s3.stop()

    with pytest.raises(RegistryError, match="cannot reach"):
        registry.publish("v2", exports["v2"], fields(), progress=outage)
    assert "could not remove the partial upload of v2" in logged[-1]  # the store was down for the clean-up too

    restarted = MotoServer(moto_s3.port).start()
    try:
        registry = open_registry(section, log=logged.append)
        assert registry.versions() == ["v1"]  # moto kept its state in-process, and v2 is not visible
        client = boto3.client("s3", endpoint_url=restarted.url)
        left = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=f"{PREFIX}/versions/v2/")["Contents"]]
        assert left == [f"{PREFIX}/versions/v2/sglang/config.json"]  # the first upload, without a manifest
        pointer, after = registry.production()
        assert pointer["version"] == "v1" and after == etag
        registry.publish("v2", exports["v2"], fields())  # the next run publishes the same id over the leftovers
        registry.fetch("v2", "sglang", tmp_path / "fetched")  # whole, every file checked
        assert registry.promote("v2", "v1", ["gate passed"], by="pipeline")["version"] == "v2"
    finally:
        restarted.stop()


def test_store_without_conditional_writes_is_refused(moto_s3):
    bucket = new_bucket(moto_s3.url)
    proxy = S3Proxy(moto_s3.url, strip_conditions=True).start()
    try:
        section = RegistrySection(backend="s3", bucket=bucket, endpoint_url=proxy.url)
        with pytest.raises(RegistryError, match="If-None-Match.*cannot be moved atomically.*conditional writes"):
            open_registry(section, log=lambda line: None)
    finally:
        proxy.stop()
    assert "Contents" not in boto3.client("s3", endpoint_url=moto_s3.url).list_objects_v2(Bucket=bucket)  # probe gone


def test_s3_upload_corrupted_on_the_way_is_refused(moto_s3, exports):
    bucket = new_bucket(moto_s3.url)
    proxy = S3Proxy(moto_s3.url, corrupt_path_prefix=f"/{bucket}/{PREFIX}/versions/").start()
    try:
        registry = open_registry(RegistrySection(backend="s3", bucket=bucket, prefix=PREFIX, endpoint_url=proxy.url),
                                 log=lambda line: None)
        with pytest.raises(RegistryError, match="stored MD5 ETag .* the upload was corrupted"):
            registry.publish("v1", exports["v1"], fields())
        assert registry.versions() == []
    finally:
        proxy.stop()
    listing = boto3.client("s3", endpoint_url=moto_s3.url).list_objects_v2(Bucket=bucket, Prefix=f"{PREFIX}/versions/")
    assert "Contents" not in listing  # the corrupted upload was removed


def test_s3_errors_are_one_line(moto_s3):
    section = RegistrySection(backend="s3", bucket="eagle3-no-such-bucket", endpoint_url=moto_s3.url)
    with pytest.raises(RegistryError, match="bucket 'eagle3-no-such-bucket' does not exist at http://127.0.0.1"):
        open_registry(section)


def test_registry_location_names_the_place_without_io(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert registry_location(RegistrySection(backend="local", path=Path("runs/registry"))) == str(tmp_path / "runs/registry")
    s3 = RegistrySection(backend="s3", bucket="drafts-bucket", prefix="/team/eagle3/")
    assert registry_location(s3) == "s3://drafts-bucket/team/eagle3"
    assert registry_location(s3.model_copy(update={"endpoint_url": "http://minio:9000"})) == (
        "s3://drafts-bucket/team/eagle3 at http://minio:9000")


def test_metrics_of_reads_the_served_and_simulated_numbers():
    metrics = metrics_of(fields(accept_length=2.1, accept_rate=0.36, simulated=2.3))
    assert (metrics.accept_length, metrics.accept_rate, metrics.simulated_accept_length, metrics.lost_requests) == (
        2.1, 0.36, 2.3, 0)
    assert metrics_of({}).accept_length is None


def test_the_gate_judges_a_candidate_against_the_production_versions_recorded_metrics(registry, exports):
    registry.publish("v1", exports["v1"], fields(accept_length=2.6, accept_rate=0.53, simulated=2.6))
    candidate = Metrics(accept_length=2.4, accept_rate=0.47, simulated_accept_length=2.45)
    first = decide_against_production(registry, candidate, None, GateSection())
    assert first.promote and first.notes == [  # no production yet: judged on its own numbers
        "throughput not measured (benchmark.baseline false and no sweep): gate.min_speedup not applied"]
    against_v1 = decide_against_production(registry, candidate, "v1", GateSection())
    assert [reason.rule for reason in against_v1.reasons] == ["regression"]  # 2.4 < 2.6 x 0.95 = 2.47
    assert "below production's 2.600" in against_v1.reasons[0].message
    assert decide_against_production(registry, candidate, "v1", GateSection(production_tolerance=0.1)).promote
    with pytest.raises(RegistryError, match="'v9' is not in the registry"):
        decide_against_production(registry, candidate, "v9", GateSection())


def test_production_re_measured_on_the_candidates_prompts_replaces_its_recorded_accept_length(registry, exports):
    """A retrain on shifted traffic is benchmarked on other prompts than production was: production's figure on the
    candidate's own prompts is what the regression rule compares with, and the decision says so."""
    registry.publish("v1", exports["v1"], fields(accept_length=2.6, accept_rate=0.53, simulated=2.6))
    candidate = Metrics(accept_length=2.1, accept_rate=0.37, simulated_accept_length=2.1)
    assert [r.rule for r in decide_against_production(registry, candidate, "v1", GateSection()).reasons] == ["regression"]
    decision = decide_against_production(registry, candidate, "v1", GateSection(), remeasured={"accept_length": 1.8})
    assert decision.promote, decision.summary()
    assert "production v1 measured on this run's prompts: accept length 1.800 (recorded 2.600" in decision.summary()
    worse = decide_against_production(registry, candidate, "v1", GateSection(), remeasured={"accept_length": 2.4})
    assert "below production's 2.400" in worse.reasons[0].message


def test_a_retrains_summary_reads_the_run_directory_its_version_names(registry, section, exports, tmp_path):
    """`eagle3 run --mode retrain` made a fresh directory under run.dir: its summary reads that run's accept lengths,
    found through the registry's record of the flow run, never the base directory's."""
    from flows.summary import run_dir_of

    config = load_config(TINY, [f"run.dir={tmp_path / 'base'}", f"registry.path={tmp_path / 'registry'}"])
    config = config.model_copy(update={"registry": section})
    retrain = tmp_path / "base" / "retrain-20261201T000000Z"
    registry.publish("v1", exports["v1"], fields() | {"config": {"run": {"dir": str(retrain)}}})
    registry.record("rejected", "v1", ["regression"], by="pipeline", run="flow-run-7")
    assert run_dir_of("flow-run-7", config, "retrain") == retrain
    assert run_dir_of("flow-run-8", config, "retrain") is None  # published nothing: no numbers rather than wrong ones
    assert run_dir_of("flow-run-8", config, "full") == tmp_path / "base"


# --- the command line --------------------------------------------------------------------------------------------

def cli(section: RegistrySection, *args: str) -> int:
    overrides = [f"registry.backend={section.backend}"]
    if section.backend == "local":
        overrides.append(f"registry.path={section.path}")
    else:
        overrides += [f"registry.bucket={section.bucket}", f"registry.prefix={section.prefix}",
                      f"registry.endpoint_url={section.endpoint_url}"]
    command, rest = args[0], list(args[1:])
    sets = [item for override in overrides for item in ("--set", override)]
    return main(["registry", command, *rest, "--config", str(TINY), *sets])


def test_cli_list_show_history(section, registry, exports, capsys):
    registry.publish("v1", exports["v1"], fields(accept_length=2.4, accept_rate=0.47))
    registry.publish("v2", exports["v2"], fields(accept_length=2.6, accept_rate=0.52, parent="v1"))
    assert load_config(TINY).gate.min_accept_rate == 0.25  # the floor the gate applies below
    capsys.readouterr()

    assert cli(section, "promote", "v1") == 0
    assert "production: v1" in capsys.readouterr().out
    assert cli(section, "list") == 0
    out = capsys.readouterr().out
    lines = {line[2:].split()[0]: line for line in out.splitlines() if line.startswith(("* ", "  "))}
    assert lines["v1"].startswith("* ") and "accept length 2.400" in lines["v1"] and "accept rate 0.470" in lines["v1"]
    assert lines["v2"].startswith("  ") and "accept length 2.600" in lines["v2"]
    assert all("  eagle3  served" in line for line in lines.values())  # each version's draft algorithm

    assert cli(section, "show", "v2") == 0
    out = capsys.readouterr().out
    assert "version: v2, draft.algorithm eagle3" in out and "served accept length 2.600" in out and "parent" in out
    assert "files: 6 in sglang, speculators" in out
    assert cli(section, "show", "v2", "--json") == 0
    assert json.loads(capsys.readouterr().out) == registry.manifest("v2")

    assert cli(section, "history") == 0
    out = capsys.readouterr().out
    assert "promoted" in out and "v1" in out and "by cli" in out

    assert cli(section, "show", "nope") == 2
    assert "'nope' is not in the registry" in capsys.readouterr().err
    assert cli(section, "rollback") == 2  # by hand, leaving no production version must be asked for by name
    assert "v1 has no previous version to roll back to; name one with --to VERSION" in capsys.readouterr().err
    assert registry.production_version() == "v1"


def test_cli_gate_refuses_then_force_promotes(section, registry, exports, capsys):
    registry.publish("v1", exports["v1"], fields(accept_length=2.4, accept_rate=0.47))
    registry.publish("v2", exports["v2"], fields(accept_length=1.1, accept_rate=0.05, simulated=1.1))
    registry.promote("v1", None, ["first"], by="pipeline")
    pointer, etag = registry.production()
    capsys.readouterr()

    assert cli(section, "promote", "v2") == 1
    out = capsys.readouterr().out
    assert "near-baseline" in out and "regression" in out and "not promoted" in out
    assert registry.production() == (pointer, etag)  # the pointer did not move
    assert registry.history()[-1]["event"] == "rejected"

    assert cli(section, "promote", "v2", "--force", "--reason", "operator override for the test") == 0
    assert registry.production()[0]["version"] == "v2"
    forced = registry.history()[-1]
    assert forced["event"] == "forced" and forced["by"] == "cli"
    assert any(reason.startswith("near-baseline") for reason in forced["reasons"])
    assert "note: operator override for the test" in forced["reasons"]

    assert cli(section, "rollback") == 0
    assert "production: v1" in capsys.readouterr().out
    assert registry.production()[0]["version"] == "v1"
    assert registry.history()[-1]["event"] == "rolled-back"
    assert registry.versions() == ["v1", "v2"]

