"""The ``witcert`` command: each subcommand is one module of this package.

A subcommand module defines ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int``, and optionally ``check(args)``: the checks that need several arguments
(or a file, a scheme, a model path, the model's tokenizer, the output directory), run before
``run`` and so before any model is loaded. A ``ValueError`` from ``check`` is reported like an
argparse error: ``witcert <command>: error: ...`` and exit status 2. Help texts show every
default (:class:`witcert.cli._args.HelpFormatter`).

Exit statuses: :mod:`witcert.cli._exit` (1 only for a soundness violation; also in docs/reference/cli.md).
"""
import argparse
import os
import pkgutil
import sys
import traceback
from importlib import import_module

from witcert.cli._args import HelpFormatter, RunFailure
from witcert.cli._exit import EXIT_FAILURE, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_SIGPIPE

DESCRIPTION = ("WitCert: sound runtime risk observability for KV-cache compression -- a proved upper bound on "
               "attention total variation for every (layer, head, decode step). Exit status: 0 done, 1 soundness "
               "violation, 2 usage error, 3 run failed, 4 internal error.")
# What a run can meet without a bug: a file that cannot be written, memory, a model that will not load.
RUN_FAILURES = (RunFailure, OSError, MemoryError)


def _subcommands():
    """(name, module) of every public module of this package that defines ``HELP`` and ``run``, sorted by name.

    A helper module a subcommand splits off (its printing, say) is not itself a subcommand.
    """
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if not info.name.startswith("_"):
            module = import_module(f"witcert.cli.{info.name}")
            if hasattr(module, "HELP") and callable(getattr(module, "run", None)):
                yield info.name, module


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
    """Parse, check (exit 2 on any bad argument), run; every failure is one line and its own exit status."""
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as typed, for the records a run writes
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
    except KeyboardInterrupt:
        _say(args, "interrupted")
        return EXIT_INTERRUPTED
    except RUN_FAILURES as err:
        _say(args, f"error: {_describe(err)}")
        return EXIT_FAILURE
    except Exception:
        traceback.print_exc()
        _say(args, "internal error (a bug in WitCert: the traceback above says where)")
        return EXIT_INTERNAL


def _say(args, message: str) -> None:
    print(f"witcert {args.command}: {message}", file=sys.stderr, flush=True)


def _describe(err: BaseException) -> str:
    if isinstance(err, OSError) and err.filename is not None:
        return f"{err.strerror or type(err).__name__}: {err.filename!r}"
    return str(err) or type(err).__name__


if __name__ == "__main__":
    sys.exit(main())
