"""The feature backend `data.capture_engine` names (eagle3/engines/features.py describes the interface). SGLang's is
imported only when chosen: it exists only in the node's SGLang environment."""

from __future__ import annotations

import torch

from eagle3.config.data import DataSection
from eagle3.config.run import TargetSection
from eagle3.engines.features import FeatureBackend, TransformersFeatures


def local_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def target_backend(data: DataSection, target: TargetSection, device: torch.device, tp_rank: int = 0,
                   tp_size: int = 1) -> FeatureBackend:
    """The backend `data.capture_engine` names, for this process."""
    if data.capture_engine == "sglang":
        from eagle3.engines.sglang_features import SGLangFeatures  # the node's SGLang environment only

        return SGLangFeatures(target.path, target.family, target.num_hidden_layers, list(data.aux_layers),
                              data.last_hidden, tp_rank, tp_size, device,
                              {**data.sglang_engine_args, "trust_remote_code": target.trust_remote_code})
    return TransformersFeatures(target, list(data.aux_layers), data.last_hidden, device)
