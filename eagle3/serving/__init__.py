"""The serving engines, by `serving.engine`: one module each behind one `ServingEngine` entry
(docs/serving-and-benchmark.md, "Serving engines"). The launcher asks the entry and nothing of the engine's own;
no other module compares an engine's name (tests/test_layering.py holds it).

SGLang and the reference server speak SGLang's HTTP API (`/health_generate`, `/server_info`, `/generate`, its metric
names): the reference server stands for an SGLang release. vLLM brings its own probe, request and answer reading
(`ServingEngine.request_body`, `read_answer`), and loads the speculators layout.
"""

from __future__ import annotations

from eagle3.errors import Eagle3Error
from eagle3.serving.base import ServingEngine
from eagle3.serving.reference import REFERENCE
from eagle3.serving.sglang import SGLANG
from eagle3.serving.vllm import VLLM_ENGINE

ENGINES: dict[str, ServingEngine] = {entry.name: entry for entry in (SGLANG, REFERENCE, VLLM_ENGINE)}


def serving_engine(name: str) -> ServingEngine:
    """The entry registered as `name` (a config's serving.engine)."""
    if name not in ENGINES:
        raise Eagle3Error(f"serving.engine {name!r} is no registered serving engine (registered: "
                          f"{', '.join(ENGINES)}); see docs/serving-and-benchmark.md")
    return ENGINES[name]
