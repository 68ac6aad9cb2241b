"""``witcert schemes``: list the registered KV-cache schemes with their one-line descriptions."""

HELP = "list the registered KV-cache compression schemes (Tier A: any cache-preserving quantizer)"


def add_arguments(parser) -> None:
    parser.add_argument("--names", action="store_true", help="print the names only, one per line")


def run(args) -> int:
    from witcert.schemes.registry import _REGISTRY, list_schemes

    names = list_schemes()
    for name in names:
        if args.names:
            print(name)
            continue
        doc = (getattr(_REGISTRY[name], "__doc__", None) or "").strip().splitlines()
        print(f"{name:<18} {doc[0] if doc else ''}")
    if not args.names:
        print("\nTier B (--tier B): dithered-int8, the dithered INT8 cache with its probabilistic certificate "
              "(non-adaptive scope).")
    return 0
