"""What a monitored cache holds, in bytes, and where: :class:`MemoryAccount` per store, :class:`MemoryReport` per monitor.

Two places, reported apart:

- **the cache** (on the model's device): the compressed keys and values as stored (packed codes and
  their scales, fp8 values, or reconstructions), the witness and value statistics, a decoded copy and
  an exact shadow (both only in validation mode, ``keep_exact=True``), and the spare room growable
  buffers allocated ahead of the tokens;
- **the backing store** (never on the device): in production (``keep_exact=False``) with a gate or the
  spot check, the request's exact keys and values, in host memory or in memory-mapped files. It is
  what a page-in or a spot check reads, so it cannot be compressed without losing what those checks
  rely on.

Every figure is the bytes of tensors actually held: ``held`` counts the tokens written, ``reserved``
the room allocated beyond them (``tests/test_memory_account.py`` sums every tensor a store holds and
finds ``held + reserved``, to the byte).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MemoryAccount:
    """Bytes one store (or a sum of stores) holds, by part, and what the exact cache would hold.

    ``compressed``: the compressed keys and values as stored (packed codes, scales, fp8 values,
    reconstructions, a quantized cache's exact window); ``witness``: the Tier A witness and the value
    statistics; ``decoded``: a cached decoded copy of the reconstruction (validation mode only);
    ``exact_shadow``: exact keys and values kept on the device (validation mode); ``reserved``: room
    growable buffers allocated beyond the tokens they hold; ``exact_cache``: the bytes an
    uncompressed cache of the same tokens holds in the model's dtype; ``backing_host`` /
    ``backing_files``: the exact keys and values of the production gate's or spot check's backing
    store, allocated in host memory / in memory-mapped files (never on the device).
    """

    compressed: int = 0
    witness: int = 0
    decoded: int = 0
    exact_shadow: int = 0
    exact_cache: int = 0
    backing_host: int = 0
    backing_files: int = 0
    reserved: int = 0

    @property
    def held(self) -> int:
        """Bytes of the tokens the cache holds on the device: compressed + witness + decoded copy + exact shadow."""
        return self.compressed + self.witness + self.decoded + self.exact_shadow

    @property
    def saved(self) -> int:
        """``exact_cache - held``: negative when the monitored cache holds more than the exact one."""
        return self.exact_cache - self.held

    @property
    def backing(self) -> int:
        """Bytes of the backing store, wherever it lives (host memory or files)."""
        return self.backing_host + self.backing_files

    def __add__(self, other: "MemoryAccount") -> "MemoryAccount":
        return MemoryAccount(*(getattr(self, f) + getattr(other, f) for f in self.__dataclass_fields__))


@dataclass(frozen=True)
class MemoryReport:
    """:meth:`witcert.integrations.hf.monitoring.Monitor.memory`: the sum over requests and each request's account.

    It compares the bytes the monitored caches hold on the device with an uncompressed cache of the
    same tokens, and states the backing store apart. In validation mode (``keep_exact=True``) the exact
    cache is held too, so nothing is saved by design: the report says so instead of printing a
    negative saving. ``str()`` prints one line per place.
    """

    total: MemoryAccount
    requests: tuple

    def lines(self) -> list[str]:
        """The report, one place per line (continued lines indented), at most 98 columns."""
        t = self.total
        rows = [("exact cache", t.exact_cache, "uncompressed, the same tokens, in the model's dtype"),
                ("held by the cache", t.held, f"on the device: compressed {t.compressed:,d} + witness {t.witness:,d}",
                 f"+ decoded copy {t.decoded:,d} + exact shadow {t.exact_shadow:,d}"),
                _saved_row(t)]
        if t.reserved:
            rows.append(("spare buffer room", t.reserved, "on the device, allocated ahead (not counted above)"))
        for where, nbytes in (("in host memory", t.backing_host), ("in files", t.backing_files)):
            if nbytes:
                rows.append(("backing store", nbytes, f"{where}, not on the device: the exact keys",
                             "(and values) the gate, spot check and audit read"))
        lines = []
        for label, nbytes, *text in rows:
            figure = "n/a" if nbytes is None else f"{nbytes:,d} B"
            lines.append(f"{label:<18} {figure:>16}  {text[0]}")
            lines += [f"{'':<37}{more}" for more in text[1:]]
        return lines

    def __str__(self) -> str:
        return "\n".join(self.lines())


def _saved_row(t: MemoryAccount) -> tuple:
    if not t.exact_cache:
        return "saved", None, "nothing cached"
    if t.exact_shadow:
        return ("saved", None, "validation mode (keep_exact=True) keeps the exact cache too:",
                f"{t.held / t.exact_cache:.1%} of it held; keep_exact=False measures the saving")
    return "saved", t.saved, (f"{t.saved / t.exact_cache:.1%} of the exact cache: {t.exact_cache / t.held:.2f}x the "
                              "tokens in its bytes")
