"""The ``witcert`` command: each subcommand is one module of this package.

A module there defines ``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``.
"""
import argparse
import pkgutil
import sys
from importlib import import_module


def _subcommands():
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if not info.name.startswith("_"):
            yield info.name, import_module(f"witcert.cli.{info.name}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="witcert", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in _subcommands():
        sub_parser = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(sub_parser)
        sub_parser.set_defaults(run=module.run)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
