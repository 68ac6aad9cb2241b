"""``witcert schemes``: list the schemes ``witcert observe --scheme`` accepts, with one-line descriptions."""
from witcert.cli import _args
from witcert.schemes.plugins import entry_points
from witcert.schemes.registry import get_scheme, list_schemes

HELP = "list the registered KV-cache compression schemes (Tier A: any cache-preserving quantizer) and installed plugins"


def add_arguments(parser) -> None:
    parser.add_argument("--names", action="store_true", help="print the names only, one per line")


def run(args) -> int:
    plugins = {name: value for name, value in entry_points().items() if name not in list_schemes()}
    rows = [(name, _first_line(get_scheme(name).__doc__)) for name in list_schemes()]
    rows += [(name, f"plugin {value} (loaded when used)") for name, value in sorted(plugins.items())]
    rows += [(name, f"[cache] {about}") for name, about in _args.CACHE_SCHEMES.items()]
    for name, about in rows:
        print(name if args.names else f"{name:<18} {about}")
    if not args.names:
        print("\nAny fn(x) -> x_hat of your own: --scheme module:function (checked before the model loads).")
    return 0


def _first_line(doc: str | None) -> str:
    lines = (doc or "").strip().splitlines()
    return lines[0] if lines else ""
