"""What the pipeline asks of a kind of draft: one `DraftAlgorithm` entry per algorithm (docs/algorithms.md).

The stages call the entry named by `draft.algorithm` (or, for a draft on disk, the entry that reads it:
`eagle3.algorithms.draft_algorithm`) and nothing of the algorithm's own: the trainer builds its model and scores its
loss through the entry, the reference server, the simulator and the trainer's replay draft with its drafter, the
launcher serves it with its flags, and the memory plan dry-runs its training step. Data, vocab map, teacher, counting,
registry and gate are the algorithm's neighbours, not its parts: they stay the same for every entry.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import torch
from pydantic import BaseModel
from torch import nn

from eagle3.algorithms.init_copy import ResolvedInit
from eagle3.config import sglang_default_aux_layers
from eagle3.config.draft import DraftSection
from eagle3.config.run import TargetSection
from eagle3.config.serving import ServingSection, SweepSection
from eagle3.config.training import TrainingSection
from eagle3.contract.problems import Report
from eagle3.errors import Eagle3Error
from eagle3.draft.files import Verifier
from eagle3.draft.vocab_map import VocabMap
from eagle3.model.teacher import Teacher
from eagle3.model.tree import DraftTree
from eagle3.model.blocks import LossRows, StepStats
from eagle3.shape import DraftShape
from eagle3.target.info import read_target_info
from eagle3.validation.external import Converted, Serving

Log = Callable[[str], None]
# (aux [P, n * TH] the target's features of the verified x_0 .. x_{P-1}, tokens [P + 1] x_0 .. x_P) -> the drafts
# after x_P. One per request: it keeps what it may reuse while the request's verified prefix grows.
Drafter = Callable[[torch.Tensor, torch.Tensor], DraftTree]


@dataclass(frozen=True)
class ExportTarget:
    """What an export is written for: the target, the serving release and shape, and the target as speculators'
    layout names it (its verifier and embedding; None when that layout is not exported)."""

    family: str
    release: str | None
    num_layers: int
    num_steps: int
    verifier: Verifier | None


def export_target(target: TargetSection, serving: ServingSection, verifier: Verifier | None) -> ExportTarget:
    """What a run's draft is exported for: its target (the layer count read from the target where it is here,
    target.num_hidden_layers where it is not), serving's release and drafting steps, and `verifier`."""
    path = Path(target.path)
    num_layers = read_target_info(path).num_hidden_layers if path.is_dir() else target.num_hidden_layers
    return ExportTarget(target.family, serving.release, num_layers, serving.num_steps, verifier)


class DraftModel(Protocol):
    """What the trainer, its parallel wrappers and its checkpoints need of a draft module besides nn.Module's own."""

    config: BaseModel

    def export_state(self) -> dict[str, torch.Tensor]: ...  # canonical tensors, on the CPU, without the target's

    def load_draft_state(self, tensors: dict[str, torch.Tensor]) -> None: ...  # their inverse, strict

    def set_recompute(self, on: bool) -> None: ...  # training.recompute: keep or recompute cheap intermediates


class DraftAlgorithm(ABC):
    """One kind of draft. A subclass names it and implements each hook; `eagle3.algorithms.ALGORITHMS` registers it."""

    name: str  # draft.algorithm
    # serving engine -> the method it serves this kind as (SGLang's --speculative-algorithm, vLLM's speculative method);
    # an engine not named does not serve it. The reference server and the simulator count it as SGLang counts that
    # method (eagle3.serving.sglang).
    served_as: dict[str, str] = {}
    section_type: type[BaseModel] | None = None  # its own fields, the config's draft.<name> (None: it has none)
    config_type: type[BaseModel]  # what draft_config returns, and what the checkpoints' config.json holds
    deployable = True  # server_flags is built (it serves): the whole pipeline (`eagle3 run`) may run it
    # the kinds (draft.algorithm names) whose drafts this one's training may start from (training.init_from; a
    # retrain's production version): a retrain warm starts only from these, and trains from scratch otherwise
    warm_start: tuple[str, ...] = ()

    def reads(self, config: dict) -> bool:
        """Whether a draft directory whose config.json holds `config` is this algorithm's, in any layout it writes
        (`eagle3.algorithms.draft_algorithm` asks every entry but EAGLE-3, whose readers take the rest)."""
        return False

    # -- the config -------------------------------------------------------------------------------

    def default_aux_layers(self, num_layers: int, draft: DraftSection) -> list[int]:
        """The target layers SGLang captures for this kind's draft when data.aux_layers names none, on a target of
        `num_layers` layers: its EAGLE-3 worker's three unless the kind's worker captures others."""
        return sglang_default_aux_layers(num_layers)

    def config_problem(self, draft: DraftSection, target: TargetSection, serving: ServingSection | None,
                       sweep: SweepSection) -> str | None:
        """Why a config (resolved: the kind's section typed, data.aux_layers set) cannot train and serve this kind's
        draft, naming the field and the fix (None: it can): what the kind asks of the target, release (serving's;
        None in a training-only config), its own section and the drafting shapes (serving's and the sweep's). The
        resolve step (eagle3.resolve) refuses the config with it at load."""
        return None

    # -- the draft --------------------------------------------------------------------------------

    @abstractmethod
    def draft_config(self, draft: DraftSection, target: TargetSection, draft_vocab_size: int,
                     aux_layers: list[int]) -> BaseModel:
        """The architecture a run trains, from the `draft` section around the target's sizes, the vocab section's
        draft_vocab_size and the target layers it reads (data.aux_layers, resolved)."""

    @abstractmethod
    def reserved_ids(self, cfg: BaseModel) -> dict[int, str]:
        """Target ids the draft gives a meaning of its own (a mask token, say), each with the config field that names
        it: the trainer refuses a run whose target generates one, naming that field."""

    @abstractmethod
    def new_model(self, cfg: BaseModel, embed: torch.Tensor) -> DraftModel:
        """The module, its weights unset; embed [V, H] is the target's, frozen. On the current default device (the
        memory plan builds it under FakeTensorMode)."""

    @abstractmethod
    def target_tensors(self, cfg: BaseModel) -> dict[str, int]:
        """The target's tensors the draft holds on each training GPU, frozen: a label each and its bytes (the memory
        plan's)."""

    @abstractmethod
    def initial_model(self, cfg: BaseModel, training: TrainingSection, head: dict[str, torch.Tensor],
                      vocab_map: VocabMap, device: torch.device, init: ResolvedInit | None, log: Log) -> DraftModel:
        """The draft of architecture `cfg` (`draft_config`'s) training starts from, on `device`: initialised by
        training.seed from the target's head (`eagle3.model.weights.target_head`) or warm-started from `init`
        (training.init_from resolved, or None)."""

    def warm_start_copy(self, source: Path, out: Path, target: ExportTarget, source_name: str, log: Log) -> str:
        """The draft at `source` (one this entry `reads`, in any layout it reads) written at `out` as the copy
        `initial_model` loads (replaced if there), read as `target`'s engine release numbers it; returns the layout it
        was read in. `source_name` says where it came from (recorded in the copy's manifest). Only asked of an entry
        some `warm_start` lists."""
        raise Eagle3Error(f"{source}: a {self.name} draft starts no training here (no algorithm's warm_start lists "
                          f"{self.name}); train from scratch (no training.init_from)")

    @abstractmethod
    def served_model(self, path: Path, release: str | None, target_dir: Path, prefix: str) -> DraftModel:
        """The exported draft at `path` as `release` of the serving engine loads it (what it skips stays untrained),
        with what it takes of the target at `target_dir` (weight names under `prefix`: target.weight_prefix)."""

    @abstractmethod
    def write_draft(self, cfg: BaseModel, tensors: dict[str, torch.Tensor], directory: Path,
                    manifest_fields: dict) -> None:
        """A training checkpoint's draft (canonical tensors) into the existing `directory`, in the layout the export
        stage and a resume read."""

    @abstractmethod
    def read_draft(self, directory: Path) -> dict[str, torch.Tensor]:
        """The canonical tensors `write_draft` wrote, checked (a resume's)."""

    # -- training ---------------------------------------------------------------------------------

    @abstractmethod
    def predictions(self, draft: DraftSection, training: TrainingSection) -> int:
        """K: the predictions each position's loss is split into (the metrics' per-step lists, the step weights)."""

    @abstractmethod
    def draft_passes(self, draft: DraftSection, training: TrainingSection) -> tuple[float, str]:
        """The positions the draft's layers run per training token, and how the config says so (the time plan's
        FLOPs)."""

    @abstractmethod
    def loss_rows(self, loss_mask: torch.Tensor, predictions: int, draft: DraftSection) -> LossRows:
        """Where the loss reads, from the loss mask [B, T] on the host."""

    @abstractmethod
    def normaliser(self, loss_mask: torch.Tensor, predictions: int, draft: DraftSection) -> torch.Tensor:
        """[K] positions each prediction is scored at over a batch's loss mask: known before any forward."""

    @abstractmethod
    def training_module(self, model: DraftModel) -> nn.Module:
        """The draft and its loss as one module whose forward(aux, input_ids, teacher, rows) returns [3, K] (loss sum,
        correct, count): what DDP and FSDP wrap. It holds the draft as `draft`."""

    @abstractmethod
    def loss(self, model: DraftModel, aux: torch.Tensor, input_ids: torch.Tensor, teacher: Teacher,
             rows: LossRows) -> StepStats:
        """The training module's sums, from the draft itself (evaluation: no wrapper hooks)."""

    # -- drafting -----------------------------------------------------------------------------------

    @abstractmethod
    def drafter(self, model: DraftModel, shape: DraftShape) -> Drafter:
        """Drafting for one request (the reference server's) or one known sequence (the simulator's replay), in
        `shape` as the serving engine drafts it."""

    # -- export -------------------------------------------------------------------------------------

    @abstractmethod
    def export(self, source: Path, directory: Path, layout: str, target: ExportTarget, log: Log) -> Path:
        """The trained draft at `source` (what `write_draft` wrote) written in `layout` (an export.layouts entry) into
        `directory`, replaced if there."""

    @abstractmethod
    def validate(self, directory: Path, layout: str, release: str | None, target_dir: Path | None,
                 data_manifest: Path | None, context_length: int | None) -> Report:
        """What `layout`'s engine (SGLang `release` for sglang) would do wrongly with the export at `directory`: one
        problem per fault, named, with its fix (eagle3.contract.problems). Checks against the target, the training
        data (its manifest) or the context length are left unknown where those are None."""

    @abstractmethod
    def convert_external(self, source: Path, dst: Path, serving: Serving, log: Log) -> Converted:
        """A draft of this kind trained elsewhere (`source`, in any layout the entry reads), validated for `serving`
        and written in the sglang layout at `dst` (only when it validates): what `eagle3 registry import` publishes
        and `eagle3 simulate --draft` replays. Raises ImportRefused naming the first problem; `Converted.draft` is the
        draft section its version records where it is not the importing config's kind."""

    # -- serving ------------------------------------------------------------------------------------

    @abstractmethod
    def kv_cache_entries(self, cfg: BaseModel, tp: int) -> float:
        """The draft's KV cache per token on one of `tp` ranks, in elements (the memory plan's serve stage)."""

    @abstractmethod
    def server_flags(self, draft_path: Path, serving: ServingSection) -> list[str]:
        """The serving engine's flags that make it draft with this algorithm from the draft at `draft_path`."""

    def shape_problem(self, draft_path: Path, shape: DraftShape) -> str | None:
        """Why the draft at `draft_path` cannot be served in `shape` (None: it can), checked before a server
        starts."""
        return None
