"""``witcert schemes``: list the schemes ``witcert observe --scheme`` accepts, with one-line descriptions.

With ``--memory``, each loaded scheme's bytes per token and kv head (keys and values) at ``--head-dim`` in bf16
(:func:`witcert.integrations.hf.footprint.footprint`: the production store's memory account of a long
prefill): the scheme's own bytes, with the production monitor's witness (its default for the scheme), the
tokens that fit in the bytes of one uncompressed bf16 token, and the same with the witness derived from the
codec's error bound (``witness_bits=0``: 2 bytes per token and kv head; ``n/a`` where the codec declares none).
"""
import argparse

from witcert.cli._args import positive_int
from witcert.schemes.catalog import CACHE_SCHEMES, entry_points, plugin_names
from witcert.schemes.engine_formats import listing
from witcert.schemes.registry import get_scheme, list_schemes

HELP = "list the registered KV-cache compression schemes (Tier A: any cache-preserving quantizer) and installed plugins"
MEMORY_HEAD = "codes  +witness  vs bf16  derived"


def add_arguments(parser) -> None:
    parser.add_argument("--names", action="store_true", help="print the names only, one per line")
    parser.add_argument("--memory", action="store_true",
                        help="also print bytes per token and kv head (keys and values, bf16 model) as the scheme "
                             "stores them and with the production monitor's witness, and the tokens held per "
                             "uncompressed token, stored and derived witness (transformers' caches need the 'quant' "
                             "extra)")
    parser.add_argument("--head-dim", type=even_head_dim, default=128,
                        help="head dimension of --memory's figures (default 128)")


def even_head_dim(text: str) -> int:
    """A positive even head dimension (whole RoPE pairs)."""
    value = positive_int(text)
    if value % 2:
        raise argparse.ArgumentTypeError(f"must be even (RoPE pairs), got {value}")
    return value


def run(args) -> int:
    plugins = entry_points()
    rows = [(name, _described(name), True) for name in list_schemes()]
    rows += [(name, f"plugin {plugins[name]} (loaded when used)", False) for name in plugin_names()]
    rows += [(name, f"[cache] {about}", True) for name, about in CACHE_SCHEMES.items()]
    memory = getattr(args, "memory", False) and not args.names  # (a caller's namespace may predate --memory)
    head_dim = getattr(args, "head_dim", 128)
    if memory:
        print(f"{'':<19} {MEMORY_HEAD}  (bytes per token and kv head at head dim {head_dim}, bf16)")
    for name, about, loaded in rows:
        columns = f"{_memory_columns(name, head_dim) if loaded else 'n/a':<{len(MEMORY_HEAD)}}  " if memory else ""
        print(name if args.names else f"{name:<19} {columns}{about}")
    if not args.names:
        print("\nAny fn(x) -> x_hat of your own: --scheme module:function (checked before the model loads).")
        if not memory:
            print("witcert schemes --memory: the bytes each holds per token, with the production monitor's witness.")
    return 0


def _memory_columns(name: str, head_dim: int) -> str:
    from witcert.integrations.hf.footprint import footprint

    try:
        f = footprint(name, head_dim)
    except ImportError:
        return "n/a (extra 'quant')"
    try:
        derived = f"{footprint(name, head_dim, witness_bits=0).capacity():6.2f}x"
    except ValueError:  # no error bound declared: the witness is stored
        derived = f"{'n/a':>7}"
    return f"{f.raw:5.0f}  {f.monitored:8.0f}  {f.capacity():5.2f}x  {derived}"


def _described(name: str) -> str:
    """The scheme's first docstring line; an engine format's summary and what a token costs, witness included."""
    return listing(name) or _first_line(get_scheme(name).__doc__)


def _first_line(doc: str | None) -> str:
    lines = (doc or "").strip().splitlines()
    return lines[0] if lines else ""
