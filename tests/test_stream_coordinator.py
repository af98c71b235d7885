"""The stream's coordinator over a real Mooncake master and store (eagle3/stream/coordinator.py): the watermarks pause
and resume the workers, a waited-for sample passes a pause, a dead worker's claims go to another, a re-run drops what
the store no longer holds, and the trainers hear why the stream cannot go on."""

from __future__ import annotations

import pytest
import torch

from eagle3.config.stream import StreamSection
from eagle3.stream.coordinator import Coordinator
from eagle3.stream.ledger import Ledger, Wanted
from eagle3.stream.store import GIB, Store, content_key, start_master
from ports import free_port

TOKEN_BYTES = 1000  # each sample below: 100 tokens, 100 KB


pytestmark = pytest.mark.usefixtures("mooncake")


@pytest.fixture(scope="module")
def stream():
    return StreamSection(master_port=free_port(), metadata_port=free_port(), coordinator_port=free_port(),
                         store_gib=1 / 64, high_watermark_gib=300_000 / GIB, low_watermark_gib=100_000 / GIB)


@pytest.fixture(scope="module")
def store(stream, tmp_path_factory):
    master = start_master(stream, tmp_path_factory.mktemp("master") / "master.log")
    try:
        store = Store(stream, "127.0.0.1", int(stream.store_gib * GIB))
        yield store
        store.close()
    finally:
        master.kill()
        master.wait()


def samples(n: int, first: int = 0) -> list[Wanted]:
    return [Wanted(content_key("settings", torch.tensor([first + i] * 100)), f"s{first + i}", 100) for i in range(n)]


def coordinator(tmp_path, stream, store) -> Coordinator:
    made = Coordinator(Ledger(tmp_path / "ledger.sqlite"), store, stream, lambda line: None)
    made.worker_started("w0")
    made.worker_started("w1")
    return made


def want(coord: Coordinator, items: list[Wanted], priority: int = 1) -> None:
    coord.want([vars(item) for item in items], priority, 0, TOKEN_BYTES)


def capture(coord: Coordinator, store: Store, worker: str, claimed: list[dict]) -> None:
    for item in claimed:
        store.put(item["store_key"], torch.zeros(item["length"], TOKEN_BYTES // 4))  # float32: TOKEN_BYTES a token
        coord.captured(worker, item["key"], item["length"] * TOKEN_BYTES, item["length"])


def test_the_watermarks_pause_the_workers_and_a_waited_for_sample_passes(tmp_path, stream, store):
    coord = coordinator(tmp_path, stream, store)
    items = samples(6)
    want(coord, items)
    first = coord.claim("w0", 10)
    assert [i["sample_id"] for i in first["items"]] == ["s0", "s1", "s2"]  # 300 KB: the high watermark's worth
    capture(coord, store, "w0", first["items"])
    assert coord.claim("w1", 10) == {"items": [], "paused": True}
    assert coord.take([vars(items[4])]) == {"ready": False}  # a trainer waits for s4: it passes the pause
    assert coord.take([vars(items[0])]) == {"ready": True, "store_keys": [first["items"][0]["store_key"]]}
    assert [i["sample_id"] for i in coord.claim("w1", 10)["items"]] == ["s4"]
    coord.consumed([items[0].key, items[1].key])  # 100 KB left of s2, and s4 claimed: 200 KB, still above low
    assert coord.claim("w0", 10)["items"] == [] and coord.paused
    coord.consumed([items[2].key])  # the claim on s4 alone: at the low watermark the workers go on, up to the high
    assert [i["sample_id"] for i in coord.claim("w0", 10)["items"]] == ["s3", "s5"]


def test_a_dead_workers_claims_go_to_another_and_none_left_alive_is_an_error(tmp_path, stream, store):
    coord = coordinator(tmp_path, stream, store)
    items = samples(2, first=10)
    want(coord, items)
    assert len(coord.claim("w0", 2)["items"]) == 2
    assert coord.claim("w1", 2)["items"] == []
    coord.worker_gone("w0", "exited with code -9")
    assert [i["sample_id"] for i in coord.claim("w1", 2)["items"]] == ["s10", "s11"]
    coord.worker_gone("w1", "exited with code 2: capture w1: put failed")
    reply = coord.take([vars(items[0])])
    assert reply == {"error": "no capture worker is alive: w0: exited with code -9; w1: exited with code 2: capture w1: "
                              "put failed"}


def test_a_rerun_keeps_what_the_store_holds_and_captures_the_rest_again(tmp_path, stream, store):
    coord = coordinator(tmp_path, stream, store)
    items = samples(3, first=20)
    want(coord, items)
    claimed = coord.claim("w0", 3)["items"]
    capture(coord, store, "w0", claimed[:2])  # s22 stays claimed by a worker of the stopped run
    store.remove(claimed[1]["store_key"])  # s21's copy is gone (as with the stopped run's store)
    again = Coordinator(coord.ledger, store, stream, lambda line: None)
    again.resume()
    assert coord.ledger.states([i.key for i in items]) == {items[0].key: "captured", items[1].key: "wanted",
                                                           items[2].key: "wanted"}
    assert coord.ledger.totals().dropped == 1
    want(again, items[1:])  # the resumed trainer announces what it reads
    recaptured = again.claim("w0", 3)["items"]
    # a capture after a drop goes under a key of its own: a late free of the first one cannot remove it
    assert [(i["sample_id"], i["store_key"]) for i in recaptured] == [("s21", f"{items[1].key}.1"),
                                                                       ("s22", f"{items[2].key}.0")]


def test_a_failed_stream_answers_every_trainer_and_worker_with_why(tmp_path, stream, store):
    coord = coordinator(tmp_path, stream, store)
    items = samples(1, first=30)
    want(coord, items)
    coord.fail("the Mooncake master on 127.0.0.1:1 (pid 1) exited with code -9")
    assert coord.take([vars(items[0])]) == {"error": "the Mooncake master on 127.0.0.1:1 (pid 1) exited with code -9"}
    assert coord.claim("w0", 1) == {"stop": "the Mooncake master on 127.0.0.1:1 (pid 1) exited with code -9"}
