"""A DSpark draft trained from an earlier one (`training.init_from`; a retrain starts from production's): DFlash's
rule for its backbone (eagle3.algorithms.dflash.warm_start), the heads' rank and type fixed like any field, the
objective's weights free (docs/training.md, "Warm starts")."""

from __future__ import annotations

from typing import Callable

from eagle3.algorithms.dflash.warm_start import NOTED as BACKBONE_NOTED, warm_start as backbone_warm_start
from eagle3.algorithms.dspark.model import DSparkDraft
from eagle3.algorithms.init_copy import ResolvedInit

# trained on with this config's value, named in the log: the backbone's (gamma, the norms' epsilon) and the
# objective's weights, which change what the weights learn next, not what they compute
NOTED = BACKBONE_NOTED + ("ce_weight", "l1_weight", "confidence_weight")


def warm_start(model: DSparkDraft, init: ResolvedInit, log: Callable[[str], None]) -> None:
    backbone_warm_start(model, init, log, NOTED)
