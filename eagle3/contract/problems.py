"""What `validate` can find in a draft checkpoint: every problem code, once, and the report that holds them.

The codes are the vocabulary shared by the validator, the diagnosis checklist (each code belongs to one
of its lines) and the config's `export.waive`, so a code can be neither misspelt nor left unchecked.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum

CONVERT_HINT = "re-export with `eagle3 convert SRC DST --to sglang --release RELEASE`"


class ProblemCode(StrEnum):
    # what the draft is
    EAGLE_NOT_EAGLE3 = "eagle-not-eagle3"  # an EAGLE v1/v2 draft, which SGLang's EAGLE3 algorithm cannot serve
    CONFIG_ARCHITECTURE = "config-architecture"  # architectures names no draft class the release loads
    # which tensors the loader keeps
    UNSUPPORTED_FLAG = "unsupported-flag"  # an architecture switch the release does not implement
    FLAG_MISPLACED = "flag-misplaced"  # a switch written where the release does not read it
    DUPLICATE_TENSOR = "duplicate-tensor"  # two tensors load into one parameter
    SKIPPED_TENSOR = "skipped-tensor"  # a tensor the loader drops without a word
    MISSING_TENSOR = "missing-tensor"  # a parameter the loader leaves at its random initialisation
    # config.json fields the engine reads
    CONFIG_MODEL_TYPE = "config-model-type"  # model_type is not 'llama'
    CONFIG_NUM_LAYERS = "config-num-layers"  # num_hidden_layers is not 1
    CONFIG_TIE_EMBEDDINGS = "config-tie-embeddings"  # tie_word_embeddings replaces the trained head
    CONFIG_TORCH_DTYPE = "config-torch-dtype"  # no torch_dtype: the engine picks one
    CONFIG_FIELD = "config-field"  # a field the shapes are derived from is absent
    # what speculators' loader needs beyond the tensors
    SPECULATORS_CONFIG = "speculators-config"  # a speculators config its loader refuses or misreads
    VERIFIER = "verifier"  # the verifier is unnamed, absent here, or not the draft's target
    # tensor shapes and dtypes
    SHAPE_MISMATCH = "shape-mismatch"  # a tensor's shape disagrees with config.json
    DTYPE = "dtype"  # a tensor's dtype is wrong, or not the declared torch_dtype
    # the draft against the target
    HIDDEN_SIZE = "hidden-size"  # hidden sizes differ from the target's
    VOCAB_SIZE = "vocab-size"  # vocab_size or t2d differ from the target's vocabulary
    DRAFT_VOCAB_SIZE = "draft-vocab-size"  # draft_vocab_size absent, null or not the rows of d2t
    # the vocab map
    D2T_ABSOLUTE = "d2t-absolute"  # d2t holds target ids where SGLang reads offsets
    D2T_OUT_OF_RANGE = "d2t-out-of-range"  # i + d2t[i] falls outside the target vocabulary
    D2T_T2D_DISAGREE = "d2t-t2d-disagree"  # d2t and t2d name different target ids
    D2T_ENCODING = "d2t-encoding"  # without t2d, d2t's encoding cannot be told
    D2T_UNSORTED = "d2t-unsorted"  # consistent, but the target ids are not ascending
    # the aux hidden states SGLang captures
    AUX_IDS_TOP_LEVEL = "aux-ids-top-level"  # aux ids only where SGLang does not read them
    AUX_IDS_INVALID = "aux-ids-invalid"  # repeated, too high, or capturing the embeddings
    AUX_IDS_AMBIGUOUS = "aux-ids-ambiguous"  # what is captured depends on the release, and none was given
    AUX_IDS_MISSING = "aux-ids-missing"  # no ids: SGLang captures its default layers
    AUX_COUNT = "aux-count"  # the number of captured states is not fc's input width
    CAPTURED_LAYERS = "captured-layers"  # the captured layers could not be worked out
    CAPTURED_LAYERS_MISMATCH = "captured-layers-mismatch"  # SGLang captures other layers than the data's
    AUX_STATES_DIFFER = "aux-states-differ"  # SGLang's capture records another state than the data's features
    # serving
    CONTEXT_LENGTH = "context-length"  # max_position_embeddings below the serving context


@dataclass(frozen=True)
class Problem:
    code: ProblemCode
    severity: str  # "error", "warning" or "unknown"
    message: str
    fix: str


@dataclass
class Report:
    path: str
    engine: str
    engine_release: str | None
    problems: list[Problem] = field(default_factory=list)

    def add(self, code: ProblemCode, severity: str, message: str, fix: str) -> None:
        self.problems.append(Problem(code, severity, message, fix))

    def of(self, severity: str) -> list[Problem]:
        return [p for p in self.problems if p.severity == severity]

    def errors(self, waived: list[str] = ()) -> list[Problem]:
        """The errors, less those whose codes are waived on purpose (`export.waive`)."""
        return [p for p in self.of("error") if p.code not in waived]

    @property
    def ok(self) -> bool:
        return not self.of("error")

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}
