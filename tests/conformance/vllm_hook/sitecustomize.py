"""Loaded by every process of a vLLM server started with this directory on PYTHONPATH (tests/conformance/
test_vllm_server.py): once vLLM's model utilities are imported, its AutoWeightsLoader.load_weights also appends to
EAGLE3_VLLM_LOAD_LOG, one JSON line per call, what it was given, what its mapper kept, what it loaded and the
parameters of the module it loaded into. vLLM's draft loaders return nothing, so this is the only way to see whether
a checkpoint tensor was dropped."""

import importlib.abc
import importlib.util
import json
import os
import sys

MODULE = "vllm.model_executor.models.utils"


def record_loads(utils) -> None:
    loader_type, given_load = utils.AutoWeightsLoader, utils.AutoWeightsLoader.load_weights

    def load_weights(self, weights, *, mapper=None):
        weights = list(weights)
        kept = [name for name, _ in (mapper or utils.WeightsMapper()).apply(iter(weights))]
        loaded = given_load(self, weights, mapper=mapper)
        line = {"module": type(self.module).__name__, "given": [name for name, _ in weights], "kept": kept,
                "loaded": sorted(loaded), "parameters": [name for name, _ in self.module.named_parameters()]}
        with open(os.environ["EAGLE3_VLLM_LOAD_LOG"], "a") as log:
            log.write(json.dumps(line) + "\n")
        return loaded

    loader_type.load_weights = load_weights


class AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)  # find the module as vLLM would, then patch it once it has run
        spec = importlib.util.find_spec(name)
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            record_loads(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, AfterImport())
