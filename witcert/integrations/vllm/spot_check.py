"""The spot check of a layer-step's decode cells, exact keys read from the gate's exact store (registry SCO, SCR).

Every checked cell of one layer and step goes through one :func:`witcert.spot.check_cells` call per key budget
(the requests' ``witcert_spot_keys``; usually one): its compressed logits and radii are the fp64 reference's
(:func:`.decode_pass.cell_terms` with ``reference=True``: the attention the meter certifies, over the keys the
cache holds now), and :class:`StoreLogits` serves the exact logits of the drawn tokens only, reading each drawn
token's key row from the :class:`~.exact_store.ExactStore` once until the store writes its slot again
(:class:`KeyReads`), checked against the CRC of the key bytes written. A key group (one row's kv head: its checked
query heads attend the same exact keys) whose history is at most the key budget per checked cell of the group is
read whole instead (``read_groups``, :mod:`witcert.spot.groups`: one verified read and one matmul per group; its
cells get their true TV rounded up, no draws): with a few hundred tokens of context and the default budget, the
usual case. The draws come from the engine's spot generator (seeded from the operating system) and are made here,
after the step's queries are fixed. A cell's bound is ``min(meter, spot bound)``, valid with probability at least
``1 - delta_cell`` (the share of the request's ``delta`` this check spends).
"""
from dataclasses import dataclass

import torch

from witcert.spot import check_cells, spot_randomness
from witcert.spot.groups import group_logits, wanted_by_group

from .decode_pass import cell_terms


class KeyReads:
    """Verified exact key rows read from the store, kept by slot until the store writes that slot again.

    A row read from the store and checked against the CRC of the key bytes written is kept as a private copy (the
    store's dtype, indexed by slot like the store): the gate's re-checks of a layer-step and the layer's next steps'
    checks read the same history, and only tokens not read yet go to the store. A kept copy holds its slot until the
    store writes that slot again (a new token in a freed block reused, :attr:`.exact_store.ExactStore.last_write`),
    then it is dropped before any use and the slot is read (and verified) anew: what a check reads is always a
    verified copy of the row the store holds now. At most one copy per slot: the store's keys once more, where read."""

    def __init__(self, store):
        self.store = store
        self.keys = torch.empty_like(store.k)  # (slots, Hkv, d): pages of a slot never read are never touched
        self.held = torch.zeros(store.k.shape[0], dtype=torch.bool)
        self.writes = store.writes  # the store's writes when ``held`` was last brought up to date

    def fetch(self, wanted: torch.Tensor) -> None:
        """Hold the slots ``wanted`` (any order, repeats): those not held read from the store (verified, each once)."""
        if self.store.writes != self.writes:  # forget what the store wrote since
            self.held &= ~torch.from_numpy(self.store.last_write > self.writes)
            self.writes = self.store.writes
        new = wanted[~self.held[wanted]]
        if new.numel():
            new = torch.unique(new)
            self.keys[new] = self.store.read_keys(new)
            self.held[new] = True

    def at(self, slots: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """fp64 key rows (N, d) of kv heads ``kv`` at ``slots`` (N,), each fetched (:meth:`fetch`) first."""
        self.fetch(slots)
        return self.keys[slots, kv].double()


class StoreLogits:
    """``logits(cells, tokens)`` of :func:`witcert.spot.check_cells` over the exact store.

    Parameters
    ----------
    store : ExactStore
    queries : Tensor (N, d)
        The checked cells' queries (as the meter reads them).
    rows, kv : Tensor (N,) int64
        Each cell's row of ``slots`` and its kv head.
    slots : Tensor (R, S) int64
        Each row's cache slot per token position.
    scale : float
        Softmax scale.
    reads : KeyReads, optional
        Key rows already read from ``store`` (the layer's checker keeps them across checks); default: none.
    """

    def __init__(self, store, queries: torch.Tensor, rows: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor,
                 scale: float, reads: KeyReads | None = None):
        self.store, self.q, self.rows, self.kv, self.slots, self.scale = store, queries.double(), rows, kv, slots, scale
        self.reads = KeyReads(store) if reads is None else reads

    def logits(self, cells: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """``scale (q_cell . k_token)`` fp64 from the exact key rows (M,)."""
        wanted = self.slots[self.rows[cells], tokens]
        if bool((wanted < 0).any()):
            raise ValueError("spot check: a drawn token lies past its sequence's length (no slot)")
        keys = self.reads.at(wanted, self.kv[cells])  # (M, d)
        return (keys * self.q[cells]).sum(-1) * self.scale

    @property
    def groups(self) -> torch.Tensor:
        """(N,) each cell's key group, its (row, kv head): cells of a group attend the same exact keys (registry
        SCO's whole reads, :mod:`witcert.spot.groups`)."""
        return self.rows * self.store.k.shape[1] + self.kv

    def dense_logits(self, cells: torch.Tensor, wanted: torch.Tensor) -> torch.Tensor:
        """``(M, S)`` fp64 exact logits of ``cells`` at the tokens ``wanted`` (M, S) bool (others 0): the union of
        each key group's wanted slots read once (verified), then one matmul per group of its cells' queries."""
        names, member, first, head, tokens = wanted_by_group(self.groups[cells], wanted)
        if not head.numel():
            return torch.zeros(wanted.shape, dtype=torch.float64)
        row_of = self.rows[cells[first]]  # each group's row (that of its first cell)
        kv_of = names - row_of * self.store.k.shape[1]
        wanted_slots = self.slots[row_of[head], tokens]
        if bool((wanted_slots < 0).any()):
            raise ValueError("spot check: a wanted token lies past its sequence's length (no slot)")
        keys = self.reads.at(wanted_slots, kv_of[head])  # (T, d): each group's tokens, by group
        return group_logits(self.q[cells], member, head, tokens, keys, self.scale, wanted.shape[1])


@dataclass(frozen=True)
class Checked:
    """One check's outcome over the checked rows' cells (R, Hkv, M): ``bound`` (NaN where no cell was checked),
    and totals: ``cells`` checked, distinct exact ``keys`` read (summed over cells), key ``bytes`` read."""

    bound: torch.Tensor
    cells: int
    keys: int
    bytes: int


class SpotChecker:
    """The engine's spot checks: one per attention layer (the store is the layer's), one generator per process.

    ``generator`` defaults to one seeded from the operating system's cryptographic source (a fixed seed is for
    tests that replay draws)."""

    def __init__(self, store, scale: float, tau: float, generator: torch.Generator | None = None):
        self.store, self.scale, self.tau = store, scale, tau
        self.reads = KeyReads(store)  # kept across the layer's checks: each row read once until written again
        self.generator = spot_randomness().generator if generator is None else generator

    def check(self, q, view: dict, lengths: torch.Tensor, over: torch.Tensor, slots: torch.Tensor,
              keys: list, delta: torch.Tensor, layout) -> Checked:
        """Spot-check the cells ``over`` (R, Hkv, M) bool of rows ``q`` (R, Hkv, M, d) over the state ``view`` (those
        rows), ``lengths`` (R, 1, M); ``slots`` (R, S) each row's slot per position (-1 past its length); ``keys``
        (R,) each row's key budget, ``delta`` (R,) its cells' failure probability."""
        bound = torch.full(over.shape, torch.nan, dtype=torch.float64)
        at = over.nonzero()  # (N, 3): row, kv head, query slot
        if not at.numel():
            return Checked(bound, 0, 0, 0)
        r, kv, m = at.T
        scores, c, local = self._terms(q, view, lengths, r, layout)
        before = self.store.bytes_checked
        budgets = torch.tensor(keys, dtype=torch.int64)[r]
        read = 0
        for budget in torch.unique(budgets).tolist():
            pick = budgets == budget
            rp, kvp, mp, lp = r[pick], kv[pick], m[pick], local[pick]
            source = StoreLogits(self.store, q[rp, kvp, mp], rp, kvp, slots, self.scale, self.reads)
            result = check_cells(scores[lp, kvp, mp], c[lp, kvp, mp], source, keys=budget, delta=delta[rp],
                                 tau=self.tau, generator=self.generator, read_groups=True)
            bound[rp, kvp, mp] = result.bound
            read += int(result.keys_read.sum())
        return Checked(bound, int(at.shape[0]), read, self.store.bytes_checked - before)

    def _terms(self, q, view: dict, lengths: torch.Tensor, r: torch.Tensor, layout) -> tuple:
        """``(scores, c, local)``: the fp64 reference's terms (:func:`.decode_pass.cell_terms`) of the rows holding a
        checked cell (``r`` (N,) each cell's row) alone, and each cell's row among them (a re-check after a repair
        checks the rewritten rows; a row's terms depend on its own query, keys, witnesses and length only)."""
        held = torch.unique(r)  # sorted
        subset = held.numel() < q.shape[0]
        if subset:
            q, lengths = q[held], lengths[held]
            view = {name: None if x is None else x[held] for name, x in view.items()}
        scores, c = cell_terms(q, view["keys"], view["witness"], view["key_norms"], lengths, view["norm_max"], layout,
                               self.scale, view["scales"], reference=True)
        return scores, c, torch.searchsorted(held, r) if subset else r
