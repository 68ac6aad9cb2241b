"""The write journal (:mod:`witcert.integrations.vllm.journal`): what it hands over and when it must be emptied.

Oracle: the slots, keys, rows and positions fed in, by hand. Exact equality (nothing is computed)."""
import torch

from witcert.integrations.vllm.journal import WriteJournal


def test_placed_steps_are_handed_over_in_order_and_the_open_step_stays():
    j = WriteJournal(32)
    assert not j and j.take() is None
    k1, k2, k3 = (torch.full((2, 1, 4), float(v)) for v in (1, 2, 3))
    j.add(torch.tensor([10, 20]), k1)
    j.place(torch.tensor([0, 1]), torch.tensor([7, 9]))
    j.close()
    j.add(torch.tensor([11, 21]), k2)
    j.close()  # a step its plan never placed: witnesses only (rows -1)
    j.add(torch.tensor([12, 22]), k3)  # the current step, not placed yet
    assert j.holds(torch.tensor([5, 21])) and j.holds(torch.tensor([22])) and not j.holds(torch.tensor([13]))
    slots, exact, rows, positions = j.take()
    assert slots.tolist() == [10, 20, 11, 21] and torch.equal(exact, torch.cat([k1, k2]))
    assert rows.tolist() == [0, 1, -1, -1] and positions.tolist() == [7, 9, -1, -1]
    assert j and not j.holds(torch.tensor([10, 21])) and j.holds(torch.tensor([12]))
    j.place(torch.tensor([0, 1]), torch.tensor([8, 10]))
    slots, _, rows, positions = j.take()
    assert slots.tolist() == [12, 22] and rows.tolist() == [0, 1] and positions.tolist() == [8, 10]
    assert not j and j.take() is None and not j.holds(torch.tensor([12]))
