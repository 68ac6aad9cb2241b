"""The written slots of steps that nothing metered yet, entered into the metering state together (T2, SR).

An unmetered step (sampling left every cell out, the audit picked none, or deferred metering queued the
rows) must still keep the append-only state the later passes read: the keys as the cache holds them, their
witnesses and norms (:mod:`.sequence_state`, :mod:`.written`). Reading each layer's few written slots back at
every step costs a handful of small tensor operations per layer; a layer's journal instead keeps the step's
exact keys and slots, and :meth:`WriteJournal.take` hands every step's writes over at once when something is
about to read the state or the witness side tensor (a metering pass, a flush, a fill from the cache, a change
of the batch). The caller then reads the slots back and forms the witnesses from those exact keys, in one
call for all the steps.

Soundness: the read-back must see what the kernel attended. A slot in the journal belongs to a running
sequence and is written once; the caller empties the journal before any write that reaches a slot it holds
(:meth:`WriteJournal.holds`: a freed block reused, a speculative token written again; :meth:`WriteJournal.may_hold`
answers the same question from write numbers, once per step for every layer), so the read-back finds
the very entries the write left, and the witness comes from the exact keys the write saw. Entries are
distinct slots, so the batched scatters never write one place twice.
"""
import torch


class WriteJournal:
    """One layer's journaled writes: per step the slots (N,), exact keys (N, Hkv, d), the write's number
    (:meth:`may_hold`) and, once the step's plan placed them, the state rows and positions (N,) (``None``: the step was
    not metered, only the witness side tensor is written). Adding a step is a list append: nothing is indexed
    until something reads the journal."""

    def __init__(self):
        self.entries = []  # [slots, exact, rows, positions, placed, write number]
        self.numbered = True  # every entry added with its write number

    def __bool__(self) -> bool:
        return bool(self.entries)

    def add(self, slots: torch.Tensor, exact: torch.Tensor, write: int | None = None) -> None:
        """A step's writes, not yet placed in the state (``write``: their write number, :meth:`may_hold`)."""
        self.entries.append([slots, exact, None, None, False, write])
        self.numbered &= write is not None

    def place(self, rows: torch.Tensor, positions: torch.Tensor) -> None:
        """The state rows and positions of the last step's writes (its plan's)."""
        self.entries[-1][2:5] = [rows, positions, True]

    def close(self) -> None:
        """End of the step's forward: a write its plan did not place keeps its witness only."""
        if self.entries:
            self.entries[-1][4] = True

    def holds(self, slots: torch.Tensor) -> bool:
        """Whether any of ``slots`` is already journaled (the journal must be entered before they are written)."""
        return any(bool(torch.isin(slots, e[0]).any()) for e in self.entries)

    def may_hold(self, slots: torch.Tensor, write: int, before: int) -> bool:
        """Whether any of ``slots`` may be journaled, from write numbers: ``write`` numbers the write about to happen,
        ``before`` the last earlier write of any of ``slots`` (``-1``: none). A journaled slot was last written by its
        entry's write (a later write would have emptied the journal first), so ``before`` is at least that entry's
        number, and no slot is held where ``before`` precedes the oldest entry: one comparison, no tensor operation.
        An entry of this same write, or one added without a number, is looked up by slot (:meth:`holds`)."""
        if not self.entries:
            return False
        if not self.numbered or self.entries[-1][5] >= write:
            return self.holds(slots)
        return before >= self.entries[0][5]

    def take(self) -> tuple | None:
        """Remove the placed steps' writes and return them concatenated: ``(slots, exact, rows, positions)``, rows
        and positions ``-1`` where a step was not placed; ``None`` if there are none."""
        done = [e for e in self.entries if e[4]]
        if not done:
            return None
        self.entries = [e for e in self.entries if not e[4]]
        self.numbered = all(e[5] is not None for e in self.entries)
        slots = torch.cat([e[0] for e in done])
        exact = torch.cat([e[1] for e in done])

        def where(k):
            return torch.cat([e[k] if e[k] is not None else torch.full_like(e[0], -1) for e in done])
        return slots, exact, where(2), where(3)
