"""The write journal (:mod:`witcert.integrations.vllm.journal`): what it hands over and when it must be emptied.

Oracle: the slots, keys, rows and positions fed in, by hand. Exact equality (nothing is computed)."""
import torch

from witcert.integrations.vllm.journal import WriteJournal


def test_placed_steps_are_handed_over_in_order_and_the_open_step_stays():
    j = WriteJournal()
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


def test_write_numbers_flag_every_journaled_slot_written_again():
    """``may_hold`` from write numbers (the runtime's, one per step) never misses a slot ``holds`` finds: every
    reuse of a journaled slot is flagged; a write after the journal was emptied, or of fresh slots, is not."""
    from witcert.integrations.vllm.runtime import Runtime
    from witcert.integrations.vllm.config import PluginConfig

    rt = Runtime(PluginConfig())
    j = WriteJournal()
    key = torch.zeros(2, 1, 4)
    steps = [[1, 2], [3, 4], [1, 5], [6, 7], [8, 9], [7, 10]]  # slots 1 and 7 written again (a block reused)
    for slots in steps:
        slots = torch.tensor(slots)
        write, before = rt.number_writes(slots)
        held = j.holds(slots)
        assert j.may_hold(slots, write, before) == held  # exact here: nothing else was written in between
        if held:
            j.close()
            j.take()
        j.add(slots, key, write)
        j.place(torch.tensor([0, 1]), torch.tensor([0, 1]))  # keeps the entry's write number
        j.close()
    assert rt.number_writes(torch.tensor([], dtype=torch.long)) == (len(steps) + 1, -1)
    j.add(torch.tensor([11]), torch.zeros(1, 1, 4), write=len(steps) + 1)  # a second write in the same numbered write
    assert j.may_hold(torch.tensor([11]), len(steps) + 1, -1) and not j.may_hold(torch.tensor([12]), len(steps) + 1, -1)
