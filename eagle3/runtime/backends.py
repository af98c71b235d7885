"""The feature backends, by `data.feature_backend` (eagle3/runtime/features.py describes the interface): a new backend
is a factory and one line of FEATURE_BACKENDS. SGLang's is imported only when chosen: it exists only in the node's
SGLang environment."""

from __future__ import annotations

from typing import Callable

import torch

from eagle3.config.data import DataSection
from eagle3.config.run import TargetSection
from eagle3.runtime.features import FeatureBackend, TransformersFeatures


def local_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def transformers_backend(data: DataSection, target: TargetSection, device: torch.device, tp_rank: int,
                         tp_size: int) -> FeatureBackend:
    """The target through transformers in this process (the whole target on `device`: no tensor parallelism)."""
    return TransformersFeatures(target, list(data.aux_layers), data.last_hidden, device)


def sglang_backend(data: DataSection, target: TargetSection, device: torch.device, tp_rank: int,
                   tp_size: int) -> FeatureBackend:
    """SGLang's model runner in this torchrun rank, the target tensor-parallel over `tp_size` ranks."""
    from eagle3.runtime.sglang_features import SGLangFeatures  # the node's SGLang environment only

    return SGLangFeatures(target.path, target.family, target.num_hidden_layers, list(data.aux_layers),
                          data.last_hidden, tp_rank, tp_size, device,
                          {**data.sglang_engine_args, "trust_remote_code": target.trust_remote_code})


BackendFactory = Callable[[DataSection, TargetSection, torch.device, int, int], FeatureBackend]
FEATURE_BACKENDS: dict[str, BackendFactory] = {"local": transformers_backend, "sglang": sglang_backend}


def target_backend(data: DataSection, target: TargetSection, device: torch.device, tp_rank: int = 0,
                   tp_size: int = 1) -> FeatureBackend:
    """The backend `data.feature_backend` names, for this process (the resolve step refused any other name)."""
    return FEATURE_BACKENDS[data.feature_backend](data, target, device, tp_rank, tp_size)
