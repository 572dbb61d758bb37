"""The cooperative-game core: pure numpy over int64 coalition bitmasks (bit i = context position i). No Ray here."""

import pipeline.game.adjusted  # noqa: E402,F401  (registers adjusted with the estimator registry)
import pipeline.game.screened  # noqa: E402,F401  (registers screened with the estimator registry)
import pipeline.game.surrogates  # noqa: E402,F401  (registers contextcite and proxyspex with the estimator registry)
from pipeline.game.adaptive import stop_reason
from pipeline.game.attribution import (
    interaction_labels,
    interactions_exact,
    interactions_from_evaluated,
    loo_effects,
    shapley_exact,
    shapley_least_squares,
    shapley_permutation,
)
from pipeline.game.clearance import (
    Clearance,
    clearance_coalitions,
    harmful_ranking,
    select_clearance,
)
from pipeline.game.plan import GamePlan, make_plan
from pipeline.game.sparse import SparseTable

__all__ = [
    "SparseTable",
    "Clearance",
    "GamePlan",
    "clearance_coalitions",
    "harmful_ranking",
    "interaction_labels",
    "interactions_exact",
    "interactions_from_evaluated",
    "loo_effects",
    "make_plan",
    "select_clearance",
    "shapley_exact",
    "shapley_least_squares",
    "shapley_permutation",
    "stop_reason",
]
