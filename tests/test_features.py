"""Target features: the transformers backend against the target's own hidden states, online training against
offline on the same batch, the streamed shard writer, and a guard that no feature passes through a Python list."""

import json

import pytest
import torch
from safetensors.torch import load_file
from torch.overrides import TorchFunctionMode
from transformers import AutoModelForCausalLM

from eagle3.bench.simulate import aux_features
from eagle3.resolve import load_config
from eagle3.data.capture import capture
from eagle3.data.regenerate import regenerate
from eagle3.data.shards import ShardReader, ShardWriter, read_dataset
from eagle3.data.storage import log_projection
from eagle3.data.vocab import build_vocab
from eagle3.runtime.features import TransformersFeatures, pad_rows
from eagle3.runtime.sglang_features import SGLangFeatures
from eagle3.errors import Eagle3Error
from eagle3.model.aux_states import aux_states, hidden_state_index
from eagle3.distributed import Dist
from eagle3.train.parts import dataset_manifest, feature_backend, training_data
from eagle3.train.trainer import Trainer
from helpers import KIMI, TINY, micro_overrides

QUIET = lambda line: None  # noqa: E731
ROWS = [[0, 2, 204, 38, 88, 277, 15, 9], [0, 2, 204], [0, 2, 204, 15, 479, 273]]


class NoFeatureLists(TorchFunctionMode):
    """Fails any `.tolist()` / `.numpy()` of a floating tensor of at least `smallest` elements: features are rows of
    hidden-size floats, and turning them into Python numbers costs ~15 ms per token at Kimi's width."""

    def __init__(self, smallest: int):
        super().__init__()
        self.smallest = smallest

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        tensor = args[0] if args else None
        if (name in ("tolist", "numpy") and isinstance(tensor, torch.Tensor) and tensor.is_floating_point()
                and tensor.numel() >= self.smallest):
            raise AssertionError(f"{name}() of a floating tensor of shape {tuple(tensor.shape)} on a feature path")
        return func(*args, **(kwargs or {}))


def test_the_guard_catches_a_feature_turned_into_a_list():
    with pytest.raises(AssertionError, match=r"tolist\(\) of a floating tensor of shape \(3, 64\)"):
        with NoFeatureLists(smallest=64):
            torch.zeros(3, 64).tolist()


def test_transformers_features_are_the_targets_own_hidden_states(micro_target):
    backend = TransformersFeatures(str(micro_target), [0, 2], "post_norm", torch.device("cpu"))
    model = AutoModelForCausalLM.from_pretrained(micro_target, dtype=torch.float32).eval()
    batch = pad_rows(ROWS, ["a", "b", "c"])
    every = backend.features(batch)
    some = backend.features(batch, slice(1, 3))
    assert every.aux.shape == (3, 8, 2 * 64) and every.last.shape == (3, 8, 64) and some.aux.shape == (2, 6, 128)
    for row, ids in enumerate(ROWS):
        with torch.no_grad():
            states = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        n = len(ids)
        # id k = the output of decoder layer k = hidden_states[k + 1]; the last state after the final norm
        torch.testing.assert_close(every.aux[row, :n], torch.cat([states[1][0], states[3][0]], -1), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(every.last[row, :n], states[-1][0], atol=1e-5, rtol=1e-5)
        if row:
            torch.testing.assert_close(some.aux[row - 1, :n], every.aux[row, :n], atol=1e-5, rtol=1e-5)
    empty = backend.features(batch, slice(3, 3))
    assert empty.aux.shape == (0, 0, 128) and empty.last.shape == (0, 0, 64)


def test_aux_id_k_is_the_output_of_decoder_layer_k(micro_target):
    """The rule the capture backend, the simulator and the reference server share: hooks on the decoder layers
    record what aux_states picks from hidden_states, which starts with the embeddings' output."""
    model = AutoModelForCausalLM.from_pretrained(micro_target, dtype=torch.float32).eval()
    seen = {}
    for k, layer in enumerate(model.model.layers):
        layer.register_forward_hook(lambda module, inputs, output, k=k: seen.__setitem__(k, output))
    ids = torch.tensor([ROWS[0]])  # [1, T]
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        torch.testing.assert_close(out.hidden_states[0], model.model.embed_tokens(ids))  # [0] is no decoder layer's
    assert hidden_state_index(0) == 1
    for layers in ([0], [0, 2], [2, 1]):  # ids below n - 1, as data.aux_layers allows; in the order given
        expected = torch.cat([seen[k][0] if isinstance(seen[k], tuple) else seen[k] for k in layers], dim=-1)
        torch.testing.assert_close(aux_states(out.hidden_states, layers), expected, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(aux_features(model, ROWS[0], layers), expected[0], atol=1e-6, rtol=1e-6)


@pytest.fixture(scope="module")
def both_modes(tmp_path_factory, micro_target):
    """The same regenerated micro data made ready for offline and for online training."""
    configs = {}
    for mode in ("offline", "online"):
        run_dir = tmp_path_factory.mktemp(mode)
        configs[mode] = config = load_config(TINY, micro_overrides(run_dir, micro_target) + [
            f"training.features={mode}", "training.batch_size=4", "training.seq_len=64", "training.ttt_steps=3",
            "training.max_steps=4", "benchmark.num_prompts=2", "benchmark.max_new_tokens=8"])
        regenerate(config, log=QUIET)
        with NoFeatureLists(smallest=64):  # capture, offline and online, keeps features as tensors
            capture(config.run, config.data, config.target, config.training, log=QUIET)
        build_vocab(config.run, config.data, config.target, config.vocab, log=QUIET)
    return configs


def test_online_stores_no_hidden_state_and_offline_does(both_modes):
    online, offline = both_modes["online"], both_modes["offline"]
    assert not (online.stage_dir("data") / "hidden").exists()
    tokens = [path.name for path in (online.stage_dir("data") / "tokens").iterdir()]
    assert "manifest.json" in tokens and any(name.startswith("shard-") for name in tokens)
    stored = load_file(next((online.stage_dir("data") / "tokens").glob("shard-*.safetensors")))
    assert set(stored) == {"input_ids", "loss_mask", "offsets"}
    features = load_file(next((offline.stage_dir("data") / "hidden").glob("shard-*.safetensors")))
    assert set(features) == {"input_ids", "loss_mask", "offsets", "aux_hidden", "last_hidden"}
    for config in (online, offline):  # both keep the held-out greedy sequences with features for the simulator
        assert len(list((config.stage_dir("data") / "heldout").glob("shard-*.safetensors"))) == 1


def test_online_and_offline_give_the_same_loss_on_the_same_batch(both_modes):
    """Offline features are stored in bf16, online ones stay float32 on the CPU: the loss agrees to bf16's rounding
    (relative 1e-2 allowed; ~2e-5 measured on the micro target), and the teacher's argmax on the same positions."""
    trainers = {mode: Trainer(config, log=QUIET) for mode, config in both_modes.items()}
    refs = trainers["offline"].data.batches(0, 4, 0)[0]
    assert refs == trainers["online"].data.batches(0, 4, 0)[0]
    with NoFeatureLists(smallest=64):
        stats = {mode: trainer.step_stats(refs, train=False) for mode, trainer in trainers.items()}
    assert torch.equal(stats["online"].count, stats["offline"].count) and stats["online"].count.sum() > 0
    torch.testing.assert_close(stats["online"].loss_sum, stats["offline"].loss_sum, rtol=1e-2, atol=0)
    with NoFeatureLists(smallest=64):
        trainers["online"].train_step(refs)  # the update path too


def test_offline_features_are_refused_for_other_tokens(both_modes):
    config = both_modes["offline"]
    data = training_data(config.run, config.training, QUIET)
    manifest = dataset_manifest(config.run, config.data, config.target, config.training)
    features = feature_backend(config.data, config.target, config.training, data, manifest, Dist(), QUIET)
    refs = data.batches(0, 4, 0)[0]
    tokens, _ = data.tokens(refs)
    tokens.input_ids[0, 1] += 1
    with pytest.raises(Eagle3Error, match=f"sample {refs[0].id}: the stored features are for other tokens"):
        features.features(tokens)


def test_a_shard_streams_in_any_order_and_appears_only_when_complete(tmp_path):
    aux = [torch.randn(5, 6), torch.randn(3, 6)]
    path = tmp_path / "shard-00000.safetensors"
    with ShardWriter(path, ["a", "b"], [5, 3], {"aux_hidden": 6, "last_hidden": 2}, {"k": 1}) as writer:
        writer.write(1, input_ids=torch.arange(3), loss_mask=torch.ones(3), aux_hidden=aux[1], last_hidden=torch.ones(3, 2))
        assert not path.exists()
        writer.write(0, input_ids=torch.arange(5), loss_mask=torch.zeros(5), aux_hidden=aux[0], last_hidden=torch.ones(5, 2))
    reader = ShardReader(path)
    assert reader.ids == ["a", "b"] and reader.offsets.tolist() == [0, 5, 8]
    assert torch.equal(reader.sample(1).aux_hidden, aux[1].bfloat16()) and reader.sample(0).input_ids.tolist() == list(range(5))
    with pytest.raises(ValueError, match="1 \\(sample, column\\) pairs never written"):
        with ShardWriter(tmp_path / "shard-00001.safetensors", ["a"], [2], {}, {}) as writer:
            writer.write(0, input_ids=torch.arange(2))
    with pytest.raises(ValueError, match="sample 0 has 2 tokens, got 3 rows of input_ids"):
        with ShardWriter(tmp_path / "shard-00002.safetensors", ["a"], [2], {}, {}) as writer:
            writer.write(0, input_ids=torch.arange(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-00000.safetensors"]  # no partial file anywhere


def test_a_sample_rewritten_under_the_same_id_is_captured_again(tmp_path, micro_target):
    """A shard's stamp holds its samples' tokens, not only their ids: rewritten samples are not served stale rows."""
    config = load_config(TINY, micro_overrides(tmp_path, micro_target) + [
        "data.num_samples=6", "benchmark.num_prompts=2", "benchmark.max_new_tokens=8"])
    regenerate(config, log=QUIET)
    capture(config.run, config.data, config.target, config.training, log=QUIET)
    regen = config.stage_dir("data") / "regen" / "samples-00000.jsonl"
    records = [json.loads(line) for line in regen.read_text().splitlines()]
    records[0]["input_ids"], records[0]["loss_mask"] = records[0]["input_ids"][:-1], records[0]["loss_mask"][:-1]
    regen.write_text("".join(json.dumps(r) + "\n" for r in records))
    capture(config.run, config.data, config.target, config.training, log=QUIET)
    stored = {s.id: s for s in read_dataset(config.stage_dir("data") / "hidden")}
    assert stored[records[0]["id"]].input_ids.tolist() == records[0]["input_ids"]


def test_the_storage_projection_of_an_online_run_is_zero_bytes_of_hidden_states():
    online, offline = [], []
    for config, lines in ((load_config(KIMI), online), (load_config(KIMI, ["training.features=offline"]), offline)):
        log_projection(config.run, config.data, config.target, config.training, lines.append)  # Kimi's trains online
    assert "no hidden state will be stored (training.features online): 0 bytes" in online[0]
    assert "57,349 bytes per token" in offline[0] and "47.0 TB" in offline[0]


def test_the_sglang_backend_cuts_its_flat_states_into_rows_without_python_lists(monkeypatch):
    """After SGLang's forward (its model runner runs in a release child: tests/conformance/test_features.py), the
    backend cuts the flat token states into padded rows by tensor copies: a .tolist() there would copy every state
    to the host on a GPU."""
    backend = object.__new__(SGLangFeatures)  # the runner is the edge: its forward's flat [N, D] states made here

    def forward(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        flat = torch.cat(rows).float()[:, None]  # [N, 1]: each token's id as its state
        return flat, torch.cat([flat, -flat], dim=1)  # last [N, 1], aux [N, 2]

    backend._forward = forward
    batch = pad_rows([[5, 6, 7], [], [8]], ["a", "b", "c"])
    with monkeypatch.context() as patched:
        patched.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("the feature path made a Python list"))
        every, last_row = backend.features(batch), backend.features(batch, slice(2, 3))
    assert torch.equal(every.last[..., 0], torch.tensor([[5.0, 6, 7], [0, 0, 0], [8, 0, 0]]))
    assert torch.equal(every.aux[2, 0], torch.tensor([8.0, -8.0]))
    assert torch.equal(last_row.last, torch.tensor([[[8.0]]]))  # one row, padded to its own length
