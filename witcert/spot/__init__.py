"""Spot-check certificate: a few exact keys drawn with the meter's own randomness (registry SCO, SC, SCB, SCD).

Valid with probability ``1 - delta`` per cell for adaptive queries and any black-box scheme; see
:mod:`witcert.spot.one_sided` (the default, ``spot_check``) and :mod:`witcert.spot.certificate`
(``spot_check_two_sided``).
"""
from witcert.spot.batched import CellChecks, check_cells
from witcert.spot.budget import RequestBudget, delta_at_step, delta_per_cell
from witcert.spot.cell import SpotCheck
from witcert.spot.certificate import spot_check_two_sided
from witcert.spot.gather import KeyGather, TableLogits
from witcert.spot.one_sided import spot_check
from witcert.spot import one_sided
from witcert.spot.randomness import SpotRandomness, spot_randomness

__all__ = ["CellChecks", "KeyGather", "RequestBudget", "SpotCheck", "SpotRandomness", "TableLogits", "check_cells", "delta_at_step",
           "delta_per_cell", "spot_check", "spot_check_two_sided", "spot_randomness"]
