"""``witcert schemes``: list the schemes ``witcert observe --scheme`` accepts, with one-line descriptions."""
from witcert.schemes.catalog import CACHE_SCHEMES, entry_points, plugin_names
from witcert.schemes.engine_formats import listing
from witcert.schemes.registry import get_scheme, list_schemes

HELP = "list the registered KV-cache compression schemes (Tier A: any cache-preserving quantizer) and installed plugins"


def add_arguments(parser) -> None:
    parser.add_argument("--names", action="store_true", help="print the names only, one per line")


def run(args) -> int:
    plugins = entry_points()
    rows = [(name, _described(name)) for name in list_schemes()]
    rows += [(name, f"plugin {plugins[name]} (loaded when used)") for name in plugin_names()]
    rows += [(name, f"[cache] {about}") for name, about in CACHE_SCHEMES.items()]
    for name, about in rows:
        print(name if args.names else f"{name:<19} {about}")
    if not args.names:
        print("\nAny fn(x) -> x_hat of your own: --scheme module:function (checked before the model loads).")
    return 0


def _described(name: str) -> str:
    """The scheme's first docstring line; an engine format's summary and what a token costs, witness included."""
    return listing(name) or _first_line(get_scheme(name).__doc__)


def _first_line(doc: str | None) -> str:
    lines = (doc or "").strip().splitlines()
    return lines[0] if lines else ""
