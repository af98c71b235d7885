"""Faults a registry meets, each leaving nothing half-visible, production on a complete version, and the next run
able to finish (local directory and S3 served by moto over HTTP):
- the run killed with SIGKILL between publish and the pointer move (it held the registry's lock);
- the S3 endpoint stopped during a promotion: before the pointer's write, and after it, before the history entry
  (the publish case: tests/test_registry.py::test_s3_outage_mid_upload_leaves_no_version);
- a crash in the retention prune after a promotion;
- two promotions racing through the pointer's compare-and-swap: tests/test_registry.py, two Registry objects.
"""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3.config.deployment import RegistrySection
from eagle3.config.run import RunSection
from eagle3.deployment.promotion import prune_after_promotion
from eagle3.registry.lock import Holder, read_holder, registry_lock
from eagle3.registry.registry import RegistryError, open_registry
from eagle3.runs import TRASH_SUFFIX, retrain_runs
from helpers import PREFIX, fields, make_run, write_checkpoint
from s3_server import MotoServer, new_bucket

FAULTS = str(Path(__file__).with_name("registry_faults.py"))


def die_at(fault: str, section: RegistrySection, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, FAULTS, fault, section.model_dump_json(), *args], text=True,
                          capture_output=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr
    return done


def assert_whole(registry, version: str, where: Path) -> None:
    """Every file of the version's manifest is there, byte for byte (fetch checks each sha256)."""
    registry.fetch(version, "sglang", where / version)


def test_a_run_killed_between_publish_and_the_pointer_move(section, tmp_path):
    registry = open_registry(section, log=lambda line: None)
    registry.publish("v1", {"sglang": write_checkpoint(tmp_path / "v1", seed=1)}, fields())
    registry.promote("v1", None, ["first"], by="pipeline")
    done = die_at("publish", section, "v2", str(write_checkpoint(tmp_path / "v2", seed=2)))
    assert "published" in done.stdout
    assert registry.production_version() == "v1"  # the pointer never moved
    assert_whole(registry, "v1", tmp_path / "fetched")
    assert registry.versions() == ["v1", "v2"]  # v2 is listed only because it is complete
    assert_whole(registry, "v2", tmp_path / "fetched")
    assert read_holder(registry.store)[0].run == "killed-run"  # the killed run never released its lock

    lines = []  # the next run: it takes the lock over at once (the holder's process on this host is dead), promotes
    with registry_lock(registry, Holder.here("next-run", lease_s=60), lines.append):
        registry.promote("v2", "v1", ["gate passed"], by="pipeline", run="next-run")
    assert any(line.startswith("registry lock: took over") and "is dead" in line for line in lines), lines
    assert registry.production_version() == "v2" and read_holder(registry.store)[0] is None
    assert [entry["event"] for entry in registry.history()] == ["promoted", "taken-over", "promoted"]


@pytest.mark.parametrize("stopped", ["before the pointer's write", "before the history entry"])
def test_the_s3_endpoint_stopped_during_a_promotion(moto_s3, tmp_path, stopped):
    section = RegistrySection(backend="s3", bucket=new_bucket(moto_s3.url), prefix=PREFIX, endpoint_url=moto_s3.url)
    logged = []
    registry = open_registry(section, log=logged.append)
    for version, seed in (("v1", 1), ("v2", 2)):
        registry.publish(version, {"sglang": write_checkpoint(tmp_path / version, seed)}, fields())
    registry.promote("v1", None, ["first"], by="pipeline")
    store, key = registry.store, "production" if stopped == "before the pointer's write" else "history/"
    put_if, put_bytes = store.put_if, store.put_bytes

    def stop_first(write):  # the endpoint goes down just as this write is sent
        def writing(written_key, *args):
            if written_key.startswith(key) and moto_s3.running:
                moto_s3.stop()
            return write(written_key, *args)
        return writing

    store.put_if, store.put_bytes = stop_first(put_if), stop_first(put_bytes)
    if stopped == "before the pointer's write":
        with pytest.raises(RegistryError, match="cannot reach"):
            registry.promote("v2", "v1", ["gate passed"], by="pipeline")
    else:  # the pointer moved: the promotion stands, and says its history entry is missing
        assert registry.promote("v2", "v1", ["gate passed"], by="pipeline")["version"] == "v2"
        assert "production moved to v2 but its history entry could not be written" in logged[-1]

    restarted = MotoServer(moto_s3.port).start()
    try:
        registry = open_registry(section, log=logged.append)
        production = registry.production_version()
        assert production == ("v1" if stopped == "before the pointer's write" else "v2")
        assert_whole(registry, production, tmp_path / "fetched")
        # the next run finishes: a promotion against what production is now
        registry.publish("v3", {"sglang": write_checkpoint(tmp_path / "v3", seed=3)}, fields())
        assert registry.promote("v3", production, ["gate passed"], by="pipeline")["previous"] == production
    finally:
        restarted.stop()


def test_a_crash_in_the_retention_prune_after_a_promotion(tmp_path):
    section = RegistrySection(backend="local", path=tmp_path / "registry")
    registry = open_registry(section, log=lambda line: None)
    runs = [make_run(tmp_path / "runs", day, (tmp_path / "registry").resolve(), size=10) for day in range(4)]
    for index, run in enumerate(runs):
        (run / "data" / "more.bin").write_bytes(b"y" * 10)
        registry.publish(f"v{index}", {"sglang": write_checkpoint(tmp_path / f"v{index}", index)},
                         fields() | {"config": {"run": {"dir": str(run)}}})
    registry.promote("v3", None, ["the newest run's"], by="pipeline")
    die_at("prune", section, str(runs[3]), "1")  # keeps the newest (runs[3], production's): removes runs[0..2]
    assert registry.production_version() == "v3"
    assert_whole(registry, "v3", tmp_path / "fetched")
    remains = runs[0].with_name(f".{runs[0].name}{TRASH_SUFFIX}")
    assert remains.is_dir() and not runs[0].exists()  # the half-deleted run is out of sight, not half a run
    assert retrain_runs(tmp_path / "runs") == runs[1:]

    lines = []  # the next prune finishes what the crash left, then goes on
    removed = prune_after_promotion(RunSection(name="retrain", dir=runs[3], keep_runs=1), section, registry,
                                    lines.append)
    assert [entry["path"] for entry in removed] == [str(runs[1]), str(runs[2])]
    assert not remains.exists() and any("interrupted prune" in line for line in lines), lines
    assert retrain_runs(tmp_path / "runs") == [runs[3]]
    assert json.loads((registry.store.root / "production").read_text())["version"] == "v3"
