"""One step's plan, shared by every layer: which state row holds which sequence, what to write, what to meter.

vLLM hands each attention layer the same step metadata (``query_start_loc``, ``seq_lens``, ``block_table``,
``slot_mapping``); the batch's request ids and prompt lengths come from the model runner
(:func:`.runtime.track_request_ids`). From them, once per step, :class:`Planner` derives a
:class:`StepPlan`:

- the state rows (:mod:`.sequence_state`): the metered rows first, in batch order, then the other rows of
  the batch; a sequence keeps its row from step to step (``moves`` copy only rows that changed place);
- which positions of a row are already valid (written by this plugin from the same cache blocks) and which
  must be read once from the cache (``fills``: a prefix another request wrote, with prefix caching; a
  sequence seen again after it left the batch; blocks the block table changed under it);
- the row and position of every token the step writes;
- the metered query rows: every query token of a decode step, and of a speculative-decoding verification
  step (its query tokens are all past the prompt: each is a decode cell attending the cache, with its own
  causal length); prefill chunks are counted, not metered.

Positions written in a step are valid from then on (all layers write the same slots); positions past a row's
length hold whatever was written there last (rejected draft tokens) and are never read.
"""
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class StepPlan:
    """What every layer does with its state in one step (fields in the module docstring).

    ``query_tokens`` / ``query_lengths`` (Rm, Qmax): per metered row (state rows ``0 .. Rm-1``), the index of each
    query token in the step's tokens and the tokens it attends; rows with fewer than ``Qmax`` query tokens
    repeat their last one (``query_counts`` says how many are real). ``batch_of_row`` (rows,): the batch row
    of each state row in use.
    """

    epoch: int
    rows: int
    tokens: int
    moves: tuple | None
    fresh: torch.Tensor | None
    batch_of_row: list
    fills: list  # (state row, batch row, start, end)
    token_rows: torch.Tensor  # (N,) the state row of each of the step's tokens
    token_positions: torch.Tensor  # (N,) its position in its sequence
    query_tokens: torch.Tensor
    query_lengths: torch.Tensor
    query_counts: list
    prefill: list = field(default_factory=list)  # (batch row, query tokens, context) of unmetered rows
    cache: dict = field(default_factory=dict)  # what the first layer derives for the step, reused by the others

    @property
    def metered_rows(self) -> int:
        return len(self.query_counts)


class Planner:
    """Keeps which state row holds which request and how much of it is valid; makes one :class:`StepPlan` per step."""

    def __init__(self):
        self.epoch = -1
        self.owner: list = []  # state row -> request id
        self.valid: list = []  # state row -> positions [0, valid) known to match the cache
        self.blocks: list = []  # state row -> the block ids those positions were written in
        self._last = None  # (step, metadata, plan) of the last step planned

    def plan(self, step: int, request_ids: list, prompt_lens: list, md, block_size: int) -> StepPlan:
        """The plan of this step (computed at the first call with this step's metadata, then reused)."""
        if self._last is not None and self._last[0] == step and self._last[1] is md:
            return self._last[2]
        plan = self._make(request_ids, prompt_lens, md, block_size)
        self._last = (step, md, plan)  # md held: its identity cannot pass to another step's metadata
        return plan

    def _make(self, request_ids: list, prompt_lens: list, md, block_size: int) -> StepPlan:
        starts = md.query_start_loc.tolist()
        seq_lens = md.seq_lens.tolist()
        batch = len(seq_lens)
        q_lens = [starts[r + 1] - starts[r] for r in range(batch)]
        contexts = [seq_lens[r] - q_lens[r] for r in range(batch)]
        ids = [request_ids[r] if r < len(request_ids) else f"row{r}" for r in range(batch)]
        prompts = [prompt_lens[r] if r < len(prompt_lens) else None for r in range(batch)]
        # a decode or verification step starts past the prompt; a prompt's (last) chunk, one token long or more,
        # is prefill (with the prompt unknown, one query token is taken for a decode step)
        metered = [r for r in range(batch) if q_lens[r] >= 1 and (contexts[r] >= prompts[r] if prompts[r] is not None
                                                                   else q_lens[r] == 1)]
        order = metered + [r for r in range(batch) if r not in set(metered)]
        moves, fresh, valid, blocks = self._arrange([ids[r] for r in order])
        table = md.block_table
        fills = []
        for row, r in enumerate(order):
            valid[row] = _still_valid(valid[row], blocks[row], table[r], block_size, contexts[r])
            if valid[row] < contexts[r]:
                fills.append((row, r, valid[row], contexts[r]))
            valid[row] = seq_lens[r]
            blocks[row] = table[r, : -(-seq_lens[r] // block_size)].clone()
        self.owner, self.valid, self.blocks = [ids[r] for r in order], valid, blocks
        self.epoch += 1
        row_of_batch = torch.empty(batch, dtype=torch.long)
        row_of_batch[torch.tensor(order, dtype=torch.long)] = torch.arange(batch)
        n = starts[-1]
        request = torch.repeat_interleave(torch.arange(batch), torch.tensor(q_lens))  # (n,)
        position = torch.arange(n) - torch.tensor(starts[:-1])[request] + torch.tensor(contexts)[request]
        query_tokens, query_lengths, counts = _query_rows(metered, starts, q_lens, contexts)
        return StepPlan(epoch=self.epoch, rows=batch, tokens=max(seq_lens, default=0), moves=moves, fresh=fresh,
                        batch_of_row=order, fills=fills, token_rows=row_of_batch[request],
                        token_positions=position, query_tokens=query_tokens, query_lengths=query_lengths,
                        query_counts=counts,
                        prefill=[(r, q_lens[r], contexts[r]) for r in order[len(metered):] if q_lens[r] > 0])

    def _arrange(self, wanted: list) -> tuple:
        """Rows for the ``wanted`` request ids (state row ``i`` holds ``wanted[i]``): the moves, the fresh rows and
        the carried validity."""
        where = {rid: row for row, rid in enumerate(self.owner) if rid is not None}
        dst, src, fresh = [], [], []
        valid, blocks = [0] * len(wanted), [None] * len(wanted)
        for row, rid in enumerate(wanted):
            old = where.get(rid)
            if old is None:
                fresh.append(row)
                continue
            valid[row], blocks[row] = self.valid[old], self.blocks[old]
            if old != row:
                dst.append(row)
                src.append(old)
        moves = (torch.tensor(dst), torch.tensor(src)) if dst else None
        return moves, (torch.tensor(fresh, dtype=torch.long) if fresh else None), valid, blocks


def _still_valid(valid: int, blocks, table_row: torch.Tensor, block_size: int, context: int) -> int:
    """How many leading positions of a row still match the cache: cut at the first block whose id changed,
    and at ``context`` (positions past it are written again this step)."""
    if not valid or blocks is None:
        return 0
    n = blocks.numel()
    current = table_row[:n]
    if not torch.equal(current, blocks.to(current.dtype)):
        changed = int((current != blocks.to(current.dtype)).nonzero()[0, 0])
        valid = min(valid, changed * block_size)
    return min(valid, context)


def _query_rows(metered: list, starts: list, q_lens: list, contexts: list) -> tuple:
    """(Rm, Qmax) query token indices and lengths of the metered rows, padded with each row's last query token."""
    counts = [q_lens[r] for r in metered]
    width = max(counts, default=1)
    tokens = torch.zeros(len(metered), width, dtype=torch.long)
    lengths = torch.ones(len(metered), width, dtype=torch.long)
    for i, r in enumerate(metered):
        j = torch.clamp(torch.arange(width), max=q_lens[r] - 1)
        tokens[i] = starts[r] + j
        lengths[i] = contexts[r] + j + 1
    return tokens, lengths, counts
