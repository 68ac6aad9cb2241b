"""The ``witcert`` command: each subcommand is one module of this package.

A subcommand module defines ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int``, and optionally ``check(args)``: the checks that need several arguments
(or a file, a scheme, a model path), run before ``run`` and so before any model is loaded. A
``ValueError`` from ``check`` is reported like an argparse error: ``witcert <command>: error: ...``
and exit status 2. Help texts show every default (:class:`witcert.cli._args.HelpFormatter`).
"""
import argparse
import os
import pkgutil
import sys
from importlib import import_module

from witcert.cli._args import HelpFormatter

DESCRIPTION = ("WitCert: sound runtime risk observability for KV-cache compression -- a proved upper bound on "
               "attention total variation for every (layer, head, decode step).")
EXIT_SIGPIPE = 128 + 13  # what a tool killed by SIGPIPE reports (e.g. `witcert schemes | head -1`)


def _subcommands():
    """(name, module) of every public module of this package, sorted by name."""
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if not info.name.startswith("_"):
            yield info.name, import_module(f"witcert.cli.{info.name}")


def build_parser() -> argparse.ArgumentParser:
    """The ``witcert`` parser with one sub-parser per subcommand module."""
    parser = argparse.ArgumentParser(prog="witcert", description=DESCRIPTION, formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in _subcommands():
        sub_parser = sub.add_parser(name, help=module.HELP, description=module.HELP, formatter_class=HelpFormatter)
        module.add_arguments(sub_parser)
        sub_parser.set_defaults(run=module.run, check=getattr(module, "check", None), parser=sub_parser)
    return parser


def main(argv=None) -> int:
    """Parse, check (exit 2 on any bad argument), run; a closed output pipe ends quietly."""
    args = build_parser().parse_args(argv)
    try:
        if args.check is not None:
            try:
                args.check(args)
            except ValueError as err:
                args.parser.error(str(err))
        status = args.run(args)
        sys.stdout.flush()  # inside the guard: a reader that left shows up here, not at exit
        return status
    except BrokenPipeError:
        # The reader went away (`| head`): stop writing, and keep the interpreter's final flush quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
