"""The test ports: each worker's slice below the kernel's ephemeral range, apart from the others', never a held port."""

import importlib.util
import socket

import ports


def test_the_workers_slices_lie_apart_below_the_ephemeral_range():
    slices = [ports.worker_slice(f"gw{index}", 3) for index in range(3)]
    for lower, upper in zip(slices, slices[1:]):
        assert lower.stop <= upper.start
    assert slices[0].start == ports.LOWEST and slices[-1].stop <= ports.first_ephemeral_port()


def fresh_ports_module(monkeypatch, worker: str, workers: int):
    """Another copy of ports.py, as worker `worker` of `workers` imports it (this worker's copy keeps its place)."""
    monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(workers))
    spec = importlib.util.spec_from_file_location("ports_of_another_worker", ports.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_held_port_is_passed_over_and_none_is_handed_out_twice(monkeypatch):
    other = fresh_ports_module(monkeypatch, "gw7", 8)
    with socket.socket() as held:
        held.bind(("127.0.0.1", other.SLICE.start))  # the first port the other worker would hand out
        handed = [other.free_port() for _ in range(20)]
    assert handed == list(other.SLICE[1:21])
