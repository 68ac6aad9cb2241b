"""Per-layer metering state of the running sequences, updated from the written slots only (never re-gathered).

vLLM's cache is paged: a sequence's keys lie in blocks scattered over the cache, in an order the kernel ISA
picks (:mod:`.layout`). Reading a sequence's whole history back from it at every step (gather, widen, pad)
was the plugin's largest cost. Instead each layer keeps, per running sequence, what the meter reads
(:mod:`.decode_pass`), written when the cache is written and indexed by token position:

- ``keys`` (rows, Hkv, cap, d) fp32: the stored keys as the kernel reads them, widened exactly (fp8 codes
  times the scale rounded to fp32, and the witness formed against that value, :mod:`.written`);
- ``witness`` (rows, Hkv, B, cap) fp16, band-major: ``>= ||(k^_t - k_t)_b||`` (rounded up);
- ``key_norms`` (rows, Hkv, cap) fp64: ``>= ||k^_t||`` (the logits' rounding bound, ``SR``);
- per pass, over the positions it reads: the largest key norm and whether any witness is above 0 (the
  zero-witness short cut and its rounding term);
- ``scales`` (rows, Hkv, n_g, cap) fp16 (the dithered cache only): Tier B's scales, ``inf`` where a token
  has no valid Tier B data.

Rows are sequences, in the order the step's plan (:mod:`.step_plan`) gives: the metered rows first, so a
step's pass reads ``[:R]`` views of these tensors, no gather. A plan's moves copy only the rows that changed
place; a fresh row starts with its maxima at 0 (its positions are written or filled from the cache before
anything reads them). Capacity grows by doubling (a copy, amortised).

What a request audit or a spot check needs per sequence (its rows, positions, the exact store's slots)
is addressed the same way: a row of this state is one sequence for the whole step.
"""
import math

import torch


class SequenceState:
    """The metering state of one attention layer (module docstring).

    Parameters
    ----------
    num_kv_heads, head_size, bands : int
        This worker's kv heads, the head dim, the Tier A bands.
    tier_b_groups : int or None
        Scale groups per key of the dithered cache (``None``: no Tier B scales kept).
    """

    def __init__(self, num_kv_heads: int, head_size: int, bands: int, tier_b_groups: int | None = None):
        self.num_kv_heads, self.head_size, self.bands, self.tier_b_groups = num_kv_heads, head_size, bands, tier_b_groups
        self.keys = torch.zeros(0, num_kv_heads, 0, head_size)
        self.witness = torch.zeros(0, num_kv_heads, bands, 0, dtype=torch.float16)
        self.key_norms = torch.zeros(0, num_kv_heads, 0, dtype=torch.float64)
        self.scales = None if tier_b_groups is None else torch.zeros(0, num_kv_heads, tier_b_groups, 0,
                                                                     dtype=torch.float16)
        self.epoch = -1  # the last plan applied

    @property
    def rows(self) -> int:
        return self.keys.shape[0]

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def arrange(self, epoch: int, rows: int, tokens: int, moves, fresh) -> None:
        """Apply a step's plan once: room for ``rows`` sequences of ``tokens`` positions, the row ``moves``
        ``(dst, src)`` (LongTensors: row ``dst[i]`` takes row ``src[i]``'s state); ``fresh`` rows (new sequences)
        need nothing: every position is written or filled before a pass reads it."""
        if epoch == self.epoch:
            return
        self._reserve(rows, tokens)
        if moves is not None:
            dst, src = moves
            for name in ("keys", "witness", "key_norms", "scales"):
                t = getattr(self, name)
                if t is not None:
                    t[dst] = t[src]  # the right side is gathered first: a permutation is safe
        self.epoch = epoch

    def write(self, rows: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, witness: torch.Tensor,
              key_norms: torch.Tensor, scales: torch.Tensor | None = None) -> None:
        """Store tokens at ``(rows[i], positions[i])`` (N,): ``keys`` (N, Hkv, d) fp32, ``witness`` (N, Hkv, B) fp16,
        ``key_norms`` (N, Hkv) fp64 (upper bounds), ``scales`` (N, Hkv, n_g) fp16 (``inf``: no Tier B data; ``None``:
        none for these tokens)."""
        self.keys[rows, :, positions] = keys
        self.witness[rows, :, :, positions] = witness
        self.key_norms[rows, :, positions] = key_norms
        if self.scales is not None:
            self.scales[rows, :, :, positions] = (torch.full_like(witness[..., :1], math.inf).expand(
                -1, -1, self.tier_b_groups) if scales is None else scales)

    def view(self, rows: int | torch.Tensor, lengths: torch.Tensor) -> dict:
        """The pass's inputs for the first ``rows`` rows (views, no copy) or the rows of a LongTensor (a copy), each
        over its ``lengths`` (R,) positions (the views span the longest): ``keys``, ``witness``, ``key_norms``,
        ``scales``, and over each row's own positions ``norm_max`` (R, Hkv) fp64 (the largest key norm) and
        ``lossy`` (R, Hkv) bool (some witness above 0)."""
        pick = slice(0, rows) if isinstance(rows, int) else rows
        tokens = int(lengths.max())
        out = {"keys": self.keys[pick, :, :tokens], "witness": self.witness[pick, :, :, :tokens],
               "key_norms": self.key_norms[pick, :, :tokens],
               "scales": None if self.scales is None else self.scales[pick, :, :, :tokens]}
        live = (torch.arange(tokens) < lengths.unsqueeze(-1)).unsqueeze(1)  # (R, 1, S)
        out["norm_max"] = torch.where(live, out["key_norms"], 0.0).amax(-1)
        out["lossy"] = (live & (out["witness"].amax(-2) != 0)).any(-1)
        return out

    def _reserve(self, rows: int, tokens: int) -> None:
        """Room for ``rows`` rows of ``tokens`` positions, growing by doubling (the content kept)."""
        if rows <= self.rows and tokens <= self.capacity:
            return
        new_rows = self.rows if rows <= self.rows else max(rows, 2 * self.rows)
        new_cap = self.capacity if tokens <= self.capacity else max(tokens, 2 * self.capacity, 16)
        old_rows, old_cap = self.rows, self.capacity

        def grown(t: torch.Tensor, token_dim: int, fill: float = 0.0) -> torch.Tensor:
            shape = list(t.shape)
            shape[0], shape[token_dim] = new_rows, new_cap
            out = torch.full(shape, fill, dtype=t.dtype)
            index = [slice(0, old_rows)] + [slice(None)] * (t.dim() - 1)
            index[token_dim] = slice(0, old_cap)
            out[tuple(index)] = t
            return out

        self.keys = grown(self.keys, 2)
        self.witness = grown(self.witness, 3)
        self.key_norms = grown(self.key_norms, 2)
        if self.scales is not None:
            self.scales = grown(self.scales, 3, math.inf)
