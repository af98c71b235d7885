"""The sample store: replies shared by the runs of one registry, on a local directory and on S3 (moto over HTTP)."""

import json
import shutil
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.resolve import load_config
from eagle3.data.regenerate import read_regenerated, regenerate
from eagle3.runtime.generators import make_generator
from eagle3.registry.registry import open_registry
from eagle3.registry.samples import SampleStore, context_key, reply_context, open_sample_store, prune_samples
from helpers import TINY, micro_overrides


def records(ids, tag="x"):
    return [{"id": pid, "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "tag": tag} for pid in ids]


def test_published_replies_are_taken_back_and_only_new_prompts_are_kept_again(section, tmp_path):
    store = SampleStore(open_registry(section).store, "c" * 32, context={"what": "test"})
    assert store.publish(records(["a", "b"]), "/runs/one") == 2
    assert store.publish(records(["b", "c"], tag="later"), "/runs/two") == 1  # b is kept once, from the first run
    taken = {r["id"]: r for r in store.take(["a", "b", "c", "d"], "/runs/three")}
    assert sorted(taken) == ["a", "b", "c"] and taken["b"]["tag"] == "x" and taken["c"]["tag"] == "later"
    index, _ = store.index()
    assert sorted(run for pack in index["packs"].values() for run in pack["runs"]) == [
        "/runs/one", "/runs/three", "/runs/three", "/runs/two"]


def test_two_writers_at_once_both_land(section):
    """Each publish adds its pack to the index by compare-and-swap: the loser re-reads and merges, nothing is lost."""
    store = open_registry(section).store
    barrier, failures = threading.Barrier(4), []

    def publish(n: int) -> None:
        barrier.wait()
        try:
            SampleStore(store, "d" * 32).publish(records([f"p{n}-{i}" for i in range(5)]), f"/runs/{n}")
        except Exception as err:  # collected: an exception in a thread would otherwise vanish
            failures.append(err)

    threads = [threading.Thread(target=publish, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    index, _ = SampleStore(store, "d" * 32).index()
    assert len(index["packs"]) == 4 and len(index["entries"]) == 20


def test_retention_deletes_the_packs_only_removed_runs_used(tmp_path):
    store = open_registry(load_config(TINY, [f"registry.path={tmp_path}"]).registry).store
    kept_by_use = SampleStore(store, "e" * 32)
    kept_by_use.publish(records(["base"]), "/runs/old")
    list(kept_by_use.take(["base"], "/runs/new"))  # a kept run took the old run's reply
    kept_by_use.publish(records(["traffic"]), "/runs/old")
    lines = []
    assert prune_samples(store, ["/runs/old"], lines.append) == 1
    index, _ = kept_by_use.index()
    assert sorted(index["entries"]) == ["base"] and [r["id"] for r in kept_by_use.take(["base", "traffic"], "/r")] == [
        "base"]
    assert len(store.list("samples/" + "e" * 32)) == 2  # the index and the one pack left
    assert any("1 entries of context" in line and "run.keep_runs" in line for line in lines)


def test_a_pack_pruned_after_the_index_was_read_is_regenerated_not_an_error(tmp_path):
    store = open_registry(load_config(TINY, [f"registry.path={tmp_path}"]).registry).store
    samples = SampleStore(store, "f" * 32)
    samples.publish(records(["a"]), "/runs/old")
    store.delete(store.list("samples/" + "f" * 32 + "/packs"))
    lines = []
    assert list(SampleStore(store, "f" * 32, lines.append).take(["a"], "/runs/new")) == []
    assert any("unreadable" in line and "entries are made again" in line for line in lines)


class CountingGenerator:
    def __init__(self, inner):
        self.inner, self.release, self.prompts = inner, inner.release, 0

    def generate(self, prompts):
        self.prompts += len(prompts)
        return self.inner.generate(prompts)

    def continue_greedy(self, prompts, length):
        return self.inner.continue_greedy(prompts, length)


def regenerated(config, lines=None):
    """Run the data stage's regeneration with the store its runner opens; the prompts generated and the records."""
    log = (lines if lines is not None else []).append
    generator = CountingGenerator(make_generator(config.data, config.target, config.training.seed))
    regenerate(config, log=log, generator=generator, store=open_sample_store(config.registry, config.data, config.target, log))
    return generator.prompts, {r["id"]: r for r in read_regenerated(config.stage_dir("data") / "regen")}


@pytest.fixture(scope="module")
def first_run(micro_target, tmp_path_factory):
    base = tmp_path_factory.mktemp("store")
    overrides = micro_overrides(base / "first", micro_target) + [f"registry.path={base / 'registry'}",
                                                                 "data.num_samples=8", "benchmark.num_prompts=2"]
    made, samples = regenerated(load_config(TINY, overrides))
    assert made == 8
    return base, overrides, samples


def test_a_second_run_takes_every_reply_and_says_so(first_run):
    base, overrides, samples = first_run
    lines = []
    made, again = regenerated(load_config(TINY, overrides + [f"run.dir={base / 'second'}"]), lines)
    assert made == 0 and again == samples
    assert any("8 of 8 replies taken from earlier runs, 0 to generate" in line for line in lines)
    more = load_config(TINY, overrides + [f"run.dir={base / 'third'}", "data.num_samples=12"])
    made, grown = regenerated(more, lines)
    assert made == 4 and all(grown[pid] == record for pid, record in samples.items())
    assert any("4 new replies kept for later runs" in line for line in lines)


@pytest.mark.parametrize("change", ["data.temperature=0.7", "data.max_new_tokens=20", "data.max_length=90",
                                    "data.thinking=true"])
def test_another_sampling_setting_or_cap_shares_nothing(first_run, change):
    base, overrides, _ = first_run
    name = change.split("=")[0].replace(".", "-")
    made, _ = regenerated(load_config(TINY, overrides + [f"run.dir={base / name}", change]))
    assert made == 8


@pytest.mark.parametrize("edit", ["weights", "chat template"])
def test_a_changed_target_shares_nothing(first_run, edit):
    base, overrides, _ = first_run
    target = base / f"target-{edit.replace(' ', '-')}"
    shutil.copytree(overrides[1].split("=", 1)[1], target)
    if edit == "weights":
        tensors = load_file(target / "model.safetensors")
        name = next(iter(tensors))
        tensors[name] = tensors[name] * 1.001  # a fine-tune: same shapes, same config and tokenizer
        save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    else:
        (target / "chat_template.jinja").write_text((target / "chat_template.jinja").read_text() + "\n")
    config = load_config(TINY, overrides + [f"run.dir={base / target.name}", f"target.path={target}"])
    other = load_config(TINY, overrides)
    assert context_key(reply_context(config.data, config.target)) != context_key(reply_context(other.data, other.target))
    made, _ = regenerated(config)
    assert made == 8


def test_share_samples_off_or_no_registry_means_no_store(first_run):
    _, overrides, _ = first_run
    lines = []
    unshared = load_config(TINY, overrides + ["data.share_samples=false"])
    assert open_sample_store(unshared.registry, unshared.data, unshared.target, lines.append) is None
    assert any("data.share_samples is off" in line for line in lines)
    plain = load_config(TINY, overrides)
    context = json.loads(json.dumps(reply_context(plain.data, plain.target)))
    assert context["target"]["path"] is None and len(context["weights_sha256"]) == 64


class CountingBackend:
    """The real local feature backend, counting the samples it computes."""

    def __init__(self, config):
        from eagle3.runtime.backends import local_device, target_backend

        self.inner = target_backend(config.data, config.target, local_device())
        self.release, self.samples = self.inner.release, 0

    def features(self, batch):
        self.samples += len(batch.sample_ids)
        return self.inner.features(batch)

    def close(self):
        self.inner.close()


def captured(config, lines):
    from eagle3.data.capture import capture
    from eagle3.data.shards import read_dataset
    from eagle3.registry.samples import open_feature_store

    backend = None

    def backend_for():
        nonlocal backend
        backend = CountingBackend(config)
        return backend

    capture(config.run, config.data, config.target, config.training, log=lines.append, backend_for=backend_for, store=open_feature_store(config.registry, config.data, config.target, config.training, lines.append))
    computed = backend.samples if backend else 0  # no backend: every shard was current
    return computed, {s.id: s for s in read_dataset(config.stage_dir("data") / "hidden")}


def test_offline_features_are_taken_from_the_store_equal_to_computed_ones(first_run):
    """The second run's training samples are the first's (taken replies): their features are copied, not computed;
    only the held-out sequences (made per run) go through the target. Other layers share nothing."""
    base, overrides, _ = first_run
    lines = []
    first = load_config(TINY, overrides)
    computed, features = captured(first, lines)
    assert computed == 8 + 2 and any("8 samples' new features kept" in line for line in lines)
    second = load_config(TINY, overrides + [f"run.dir={base / 'features'}"])
    regenerated(second)
    lines = []
    computed, again = captured(second, lines)
    assert computed == 2 and any("8 of 8 samples' features taken from earlier runs, 0 to compute" in line
                                 for line in lines)
    assert again.keys() == features.keys()
    for sid, sample in again.items():
        assert torch.equal(sample.aux_hidden, features[sid].aux_hidden)
        assert torch.equal(sample.last_hidden, features[sid].last_hidden)
    other = load_config(TINY, overrides + [f"run.dir={base / 'features-layers'}", "data.aux_layers=[0, 2]"])
    regenerated(other)
    computed, _ = captured(other, [])
    assert computed == 8 + 2


def test_a_batch_of_stored_and_computed_samples_gets_each_samples_own_features(first_run):
    """12 samples after 8 were stored: batches of 8 mix copied and computed rows; every row equals a capture without
    the store."""
    base, overrides, _ = first_run
    grown = overrides + ["data.num_samples=12"]
    with_store = load_config(TINY, grown + [f"run.dir={base / 'mixed'}"])
    regenerated(with_store)
    captured(load_config(TINY, overrides), [])  # the first run's 8 samples' features are in the store
    lines = []
    computed, mixed = captured(with_store, lines)
    assert any("8 of 12 samples' features taken" in line for line in lines) and computed == 4 + 2
    plain = load_config(TINY, grown + [f"run.dir={base / 'plain'}", "data.share_samples=false"])
    regenerated(plain)
    _, alone = captured(plain, [])
    assert mixed.keys() == alone.keys()
    for sid, sample in mixed.items():
        assert torch.allclose(sample.aux_hidden.float(), alone[sid].aux_hidden.float(), atol=1e-2), sid
        assert torch.allclose(sample.last_hidden.float(), alone[sid].last_hidden.float(), atol=1e-2), sid


def test_packs_the_index_never_named_are_swept_after_a_day_and_kept_before(tmp_path):
    from eagle3.registry.samples import PackStore, orphans

    store = open_registry(load_config(TINY, [f"registry.path={tmp_path}"]).registry).store
    samples = SampleStore(store, "b" * 32)
    samples.publish(records(["named"]), "/runs/one")
    store.put_bytes(f"samples/{'b' * 32}/packs/1000-{'0' * 32}.jsonl", b"{}\n")  # its publisher died in 1970
    pack = PackStore(store, "samples", "b" * 32)
    assert orphans(pack) == [f"samples/{'b' * 32}/packs/1000-{'0' * 32}.jsonl"]
    assert orphans(pack, now=1000.0) == []  # not a day old yet
    prune_samples(store, ["/runs/gone"])
    assert [r["id"] for r in samples.take(["named"], "/runs/two")] == ["named"]
    assert len(store.list(f"samples/{'b' * 32}/packs")) == 1


def test_a_target_whose_weights_are_not_here_gets_no_store_and_says_why(first_run, tmp_path):
    """A target served from the nodes' own disks (data.nodes, data.servers) cannot be fingerprinted here."""
    _, overrides, _ = first_run
    target = tmp_path / "config-only"
    shutil.copytree(overrides[1].split("=", 1)[1], target, ignore=shutil.ignore_patterns("*.safetensors"))
    lines = []
    elsewhere = load_config(TINY, overrides + [f"target.path={target}"])
    assert open_sample_store(elsewhere.registry, elsewhere.data, elsewhere.target, lines.append) is None
    assert any("weights are not under target.path" in line and "cannot be fingerprinted" in line for line in lines)
