"""Train–serve diagnosis: when the served accept length falls short of the simulated one, name the
likely cause. Every check reports passed / failed / unknown with its evidence; the checks are the
validator's (one source of truth for what SGLang does) plus what only a live run can tell.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from eagle3.algorithms import draft_algorithm
from eagle3.data.conversation import chat_template_hash
from eagle3.runtime.targets import load_tokenizer
from eagle3.records.manifest import read_manifest
from eagle3.contract.problems import ProblemCode as Code
from eagle3.serving.base import ServingEngine
from eagle3.serving.sglang import SGLANG

VOCAB_LINE = "draft vocab vs tokenizer"
CONTINUATION_LINE = "replayed continuation vs the server's greedy output"

# checklist line -> the validation problem codes it covers; every code is on exactly one line. An error or a
# warning with one of a line's codes fails it; a check `validate` could not run leaves it unknown.
CHECKS: dict[str, tuple[Code, ...]] = {
    "tensors the release would skip": (
        Code.SKIPPED_TENSOR, Code.MISSING_TENSOR, Code.DUPLICATE_TENSOR, Code.UNSUPPORTED_FLAG, Code.FLAG_MISPLACED,
    ),
    "tensor shapes and dtypes vs config.json": (Code.SHAPE_MISMATCH, Code.DTYPE),
    "config.json fields the engine reads": (
        Code.CONFIG_MODEL_TYPE, Code.CONFIG_NUM_LAYERS, Code.CONFIG_TIE_EMBEDDINGS, Code.CONFIG_TORCH_DTYPE,
        Code.CONFIG_FIELD, Code.SPECULATORS_CONFIG, Code.VERIFIER,
    ),
    "d2t encoding (offsets)": (
        Code.D2T_ABSOLUTE, Code.D2T_OUT_OF_RANGE, Code.D2T_T2D_DISAGREE, Code.D2T_ENCODING, Code.D2T_UNSORTED,
    ),
    "captured layers vs the data's": (
        Code.CAPTURED_LAYERS_MISMATCH, Code.CAPTURED_LAYERS, Code.AUX_IDS_MISSING, Code.AUX_IDS_TOP_LEVEL,
        Code.AUX_IDS_INVALID, Code.AUX_IDS_AMBIGUOUS, Code.AUX_COUNT, Code.AUX_STATES_DIFFER,
    ),
    "EAGLE3, not EAGLE": (Code.EAGLE_NOT_EAGLE3, Code.CONFIG_ARCHITECTURE),
    "max_position_embeddings vs prompt lengths": (Code.CONTEXT_LENGTH,),
    VOCAB_LINE: (Code.VOCAB_SIZE, Code.DRAFT_VOCAB_SIZE, Code.HIDDEN_SIZE),  # last, judged beside the tokenizer
}


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # "passed", "failed" or "unknown"
    evidence: str


@dataclass
class Diagnosis:
    simulated: float | None
    served: float | None
    gap: float | None  # relative shortfall of served vs simulated
    checks: list[Check]

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status == "failed"]

    def to_dict(self) -> dict:
        return {**asdict(self), "failed": [c.name for c in self.failed]}

    def render(self) -> str:
        lines = [f"accept length: simulated {self.simulated}, served {self.served}"
                 + (f" ({self.gap:.0%} short)" if self.gap is not None else "")]
        for check in self.checks:
            lines.append(f"  [{check.status:7s}] {check.name}: {check.evidence}")
        return "\n".join(lines)


def diagnose(
    checkpoint: Path,
    release: str | None,
    target: Path,
    data_dir: Path,
    simulated: float | None,
    served: float | None,
    longest_request: int | None = None,
    greedy: dict | None = None,
    url: str | None = None,
    max_new_tokens: int | None = None,
    trust_remote_code: bool = False,
    engine: ServingEngine = SGLANG,
) -> Diagnosis:
    """`data_dir` holds the captured dataset's manifest; `longest_request` = prompt + new tokens. `greedy` (a stored
    held-out greedy sequence: id, prompt_ids, continuation_ids) is compared with what `engine`'s server at `url`
    generates for its prompt, greedy, `max_new_tokens` long."""
    report = draft_algorithm(Path(checkpoint)).validate(Path(checkpoint), "sglang", release, target, data_dir,
                                                        longest_request)
    checks = [_from_report(name, codes, report) for name, codes in CHECKS.items() if name != VOCAB_LINE]
    manifest = read_manifest(data_dir)
    tokenizer = load_tokenizer(target, trust_remote_code)
    checks.append(_template_check(manifest, tokenizer))
    checks.append(_vocab_check(report, tokenizer))
    checks.append(continuation_check(greedy, url, max_new_tokens, tokenizer, engine))
    gap = None if not simulated or served is None else (simulated - served) / simulated
    return Diagnosis(simulated, served, gap, checks)


def _from_report(name: str, codes: tuple[Code, ...], report) -> Check:
    hits = [p for p in report.problems if p.code in codes and p.severity in ("error", "warning")]
    unknown = [p for p in report.problems if p.code in codes and p.severity == "unknown"]
    if hits:
        return Check(name, "failed", "; ".join(f"{p.code}: {p.message}" for p in hits))
    if unknown:
        return Check(name, "unknown", "; ".join(p.message for p in unknown))
    return Check(name, "passed", "no problem found by `eagle3 validate`")


def _template_check(manifest: dict, tokenizer) -> Check:
    data, served = manifest.get("chat_template_sha256"), chat_template_hash(tokenizer)
    if data is None:
        return Check("chat template of data vs server", "unknown", "the data manifest records no template hash")
    if data != served:
        return Check("chat template of data vs server", "failed",
                     f"data made with template {data[:12]}…, the server's tokenizer has {served[:12]}…")
    return Check("chat template of data vs server", "passed", f"both {served[:12]}…")


def _vocab_check(report, tokenizer) -> Check:
    mismatch = [p for p in report.problems if p.code in CHECKS[VOCAB_LINE]]
    if mismatch:
        return Check(VOCAB_LINE, "failed", "; ".join(p.message for p in mismatch))
    return Check(VOCAB_LINE, "passed", f"the draft's ids lie in the target vocabulary; tokenizer has {len(tokenizer)} "
                 "ids")


def continuation_check(greedy: dict | None, url: str | None, max_new_tokens: int | None, tokenizer,
                       engine: ServingEngine) -> Check:
    """The simulator replays the target's greedy continuation stored by the data stage; when the server's target
    generates another one, simulated acceptance describes a sequence the server never produces."""
    if greedy is None or url is None or not max_new_tokens:
        return Check(CONTINUATION_LINE, "unknown", "needs a stored held-out continuation (the data stage's) and a "
                     "running server (--url)")
    body = engine.request_body(greedy["prompt_ids"], max_new_tokens, 0.0, {})
    generate = f"{url.rstrip('/')}{engine.generate_path}"
    try:
        response = httpx.post(generate, json=body, timeout=600).raise_for_status()
        served = engine.answer(response.json())["output_ids"]
    except (httpx.HTTPError, ValueError) as err:
        return Check(CONTINUATION_LINE, "unknown", f"{generate}: {err!r}")
    stored = greedy["continuation_ids"][: len(served)]  # the server may end its turn: compare up to there
    parted = next((i for i, (a, b) in enumerate(zip(stored, served)) if a != b), None)
    if parted is None:
        return Check(CONTINUATION_LINE, "passed", f"prompt {greedy['id']}: the server's {len(served)} greedy tokens "
                     "equal the stored continuation")
    shown = lambda token: f"{token} {tokenizer.decode([token])!r}"  # noqa: E731
    return Check(CONTINUATION_LINE, "failed",
                 f"prompt {greedy['id']}: the stored continuation and the server's greedy output part at token "
                 f"{parted + 1} of {len(served)} (stored {shown(stored[parted])}, served {shown(served[parted])}): the "
                 "simulator replays a sequence the server never produces. Likely the target runs at another precision "
                 "in the data stage than on the server (target.dtype), or the server loads other target weights")
