"""The ``split-mass`` fuzz attack class (CS and MS where they bind; issue 12).

Implementation: ``witcert.verification.attacks.split_mass`` (``meter``, ``chi_square_bound``,
``mass_split_bound`` per query). Oracle: the sup-box adversary (exact for S <= 12), re-decided at
50 digits near a miss, and the 50-digit CS/MS statements. Domain: the class's four generators,
fp32 and fp64, small ``n``. Tolerance: 0 violations; a planted unsound bound is caught.
"""
import torch

from witcert.verification.attacks import ATTACKS, split_mass


def test_split_mass_attack_finds_nothing():
    tally = split_mass.run(48, torch.Generator().manual_seed(0))
    assert "split_mass" in ATTACKS
    assert tally.cells > 0 and tally.violations == 0, tally.notes


def test_split_mass_attack_catches_a_bound_one_percent_low(monkeypatch):
    """The class has teeth: MS scaled by 0.99 is below the sup box or its statement somewhere."""
    sound = split_mass._CHECKED["mass_split"]
    monkeypatch.setitem(split_mass._CHECKED, "mass_split", lambda s, c: sound(s, c) * 0.99)
    assert split_mass.run(48, torch.Generator().manual_seed(0)).violations > 0
