"""Argument types and checks shared by the subcommands: every bad value is rejected while parsing.

Each ``type=`` function raises ``argparse.ArgumentTypeError`` with what was wrong, so argparse
prints ``witcert <command>: error: argument --x: ...`` and exits with status 2 before any work
(and before any model is loaded). Checks that need several arguments at once are a
subcommand's ``check(args)`` (``witcert.cli.main`` turns its ``ValueError`` into the same error).
"""
import argparse
import importlib.util
import math
import os
from pathlib import Path

from witcert.integrations.hf.quantized_cache import HF_CACHE_SCHEMES  # no transformers import

# Names `witcert observe --scheme` accepts that are caches rather than tensor functions in the scheme
# registry. DITHERED is witcert.integrations.hf.monitoring.DITHERED, kept here because importing that
# module loads transformers, which the argument check must not.
DITHERED = "dithered-int8"
CACHE_SCHEMES = {
    DITHERED: "the dithered INT8 cache (witcert.DitheredInt8) with its Tier B certificate "
              "(--tier B; the probabilistic branch for non-adaptive queries only)",
    **{name: f"transformers' own QuantizedCache, {spec.backend} {spec.nbits}-bit (axis 0, groups of "
             f"{spec.q_group_size}, exact window of {spec.residual_length}; maintained witnesses; extra 'quant')"
       for name, spec in HF_CACHE_SCHEMES.items()},
}


def require_installed(command: str, extra: str, *modules: str) -> None:
    """``ValueError`` naming the extra to install when one of ``modules`` is missing (nothing is imported)."""
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(f"{command} needs {', '.join(missing)}, which is not installed: "
                         f"pip install 'witcert[{extra}]' (or `make install` in a checkout)")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: ...)`` for every option with a real default (not for flags or ``None``)."""

    def _get_help_string(self, action):
        if action.default is None or isinstance(action.default, bool):
            return action.help  # flags, and options whose default the help text states in words
        return super()._get_help_string(action)


def positive_int(text: str) -> int:
    """An int >= 1."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """An int >= 0."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def open_unit_interval(text: str) -> float:
    """A float strictly between 0 and 1 (a certified threshold)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1), got {text!r}") from None
    if not (math.isfinite(value) and 0.0 < value < 1.0):
        raise argparse.ArgumentTypeError(f"must lie strictly between 0 and 1 (certified regime), got {text!r}")
    return value


def philox_seed(text: str) -> int:
    """A Philox seed: an int in [0, 2^64)."""
    value = _int(text)
    if not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2^64), got {text!r}")
    return value


def existing_path(text: str) -> Path:
    """A path that exists."""
    path = Path(text).expanduser()
    if not path.exists():
        raise argparse.ArgumentTypeError(f"no such file or directory: {text!r}")
    return path


def output_file(text: str) -> Path:
    """A file path that can be written: its directory exists and it is not itself a directory."""
    path = Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a file path")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"directory {str(parent)!r} of {text!r} does not exist")
    if not os.access(parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"directory {str(parent)!r} of {text!r} is not writable")
    return path


def output_dir(text: str) -> Path:
    """A directory path to create or reuse: not an existing file."""
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not a directory")
    return path


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
