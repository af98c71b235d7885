"""Train–serve diagnosis: when the served accept length falls short of the simulated one, name the
likely cause. Every check reports passed / failed / unknown with its evidence; the checks are the
validator's (one source of truth for what SGLang does) plus what only a live run can tell.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from eagle3.data.conversation import chat_template_hash
from eagle3.engines.targets import load_tokenizer
from eagle3.formats.manifest import read_manifest
from eagle3.formats.validate import validate

# checklist line -> validation problem codes that fail it
CHECKS = {
    "tensors the release would skip": ("skipped-tensor", "missing-tensor", "duplicate-tensor", "unsupported-flag"),
    "d2t encoding (offsets)": ("d2t-absolute", "d2t-out-of-range", "d2t-t2d-disagree", "d2t-encoding"),
    "captured layers vs the data's": (
        "captured-layers-mismatch", "captured-layers", "aux-ids-missing", "aux-ids-top-level", "aux-ids-invalid",
        "aux-ids-ambiguous", "aux-count",
    ),
    "EAGLE3, not EAGLE": ("eagle-not-eagle3", "config-architecture"),
    "max_position_embeddings vs prompt lengths": ("context-length",),
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
    engine_release: str | None,
    target: Path,
    data_dir: Path,
    simulated: float | None,
    served: float | None,
    longest_request: int | None = None,
) -> Diagnosis:
    """`data_dir` holds the captured dataset's manifest; `longest_request` = prompt + new tokens."""
    report = validate(checkpoint, engine_release=engine_release, target=target, data_manifest=data_dir,
                      context_length=longest_request)
    checks = [_from_report(name, codes, report) for name, codes in CHECKS.items()]
    manifest = read_manifest(data_dir)
    tokenizer = load_tokenizer(str(target))
    checks.append(_template_check(manifest, tokenizer))
    checks.append(_vocab_check(report, tokenizer))
    gap = None if not simulated or served is None else (simulated - served) / simulated
    return Diagnosis(simulated, served, gap, checks)


def _from_report(name: str, codes: tuple[str, ...], report) -> Check:
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
    mismatch = [p for p in report.problems if p.code in ("vocab-size", "draft-vocab-size", "hidden-size")]
    if mismatch:
        return Check("draft vocab vs tokenizer", "failed", "; ".join(p.message for p in mismatch))
    return Check("draft vocab vs tokenizer", "passed", f"t2d spans the target vocabulary; tokenizer has {len(tokenizer)} ids")
