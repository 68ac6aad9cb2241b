"""Argument types and checks shared by the subcommands: every bad value is rejected while parsing.

Each ``type=`` function raises ``argparse.ArgumentTypeError`` with what was wrong, so argparse
prints ``witcert <command>: error: argument --x: ...`` and exits with status 2 before any work
(and before any model is loaded). Checks that need several arguments at once are a
subcommand's ``check(args)`` (``witcert.cli.main`` turns its ``ValueError`` into the same error).
"""
import argparse
import importlib.util
import math
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from witcert.core.thresholds import check_certified_tau


MAX_CONTEXT = 1 << 16  # the longest context the --context check searches


class RunFailure(Exception):
    """A run that could not be carried out once the arguments were accepted (the model would not load, an output
    could not be written): reported in one line, exit status :data:`witcert.cli.EXIT_FAILURE`."""


def default_out(command: str) -> Path:
    """The default report directory of ``command``: ``reports/<command>-<UTC time>``."""
    return Path("reports") / f"{command}-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"


def load_checked_model(path: Path | None):
    """``default_model.load_model(path)``; a failure (a broken checkpoint, a missing file) is a :class:`RunFailure`."""
    from witcert.integrations.hf import default_model  # transformers loads only now

    try:
        return default_model.load_model(path)
    except Exception as err:  # transformers raises many kinds; all of them mean the run cannot start
        raise RunFailure(f"the model could not be loaded ({type(err).__name__}: {err})") from err


def context_too_small(context: int, build, err: ValueError) -> ValueError:
    """The ``--context`` error of a needle workload that ``build(context)`` rejected, with the least that fits.

    ``build(tokens)`` builds the workload at ``tokens`` context tokens (``ValueError`` when they do
    not hold the prompt); bisection finds the least accepted value (tokenizing is cheap).
    """
    def fits(tokens: int) -> bool:
        try:
            build(tokens)
        except ValueError:
            return False
        return True

    low, high = context, MAX_CONTEXT  # low fails
    if not fits(high):
        return ValueError(f"--context {context}: {err}")
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if fits(middle) else (middle, high)
    return ValueError(f"--context {context} is too small for the needle prompt with this model's tokenizer: "
                      f"give --context {high} or more")


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


def certified_tau(text: str) -> float:
    """A certified threshold: a number strictly between 0 and 1 (``check_certified_tau``, as ``witcert.monitor``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1), got {text!r}") from None
    try:
        return check_certified_tau(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def audit_rate(text: str) -> float:
    """A request audit's pick rate: a number in (0, 1] (``witcert.Audit``)."""
    from witcert.audit.settings import Audit

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}") from None
    try:
        return Audit(rate=value).rate
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def risk_threshold(text: str) -> float:
    """A risk-ranked gate threshold: a finite number >= 1 (``witcert.Gate``'s risk regime)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 1, got {text!r}") from None
    if not (math.isfinite(value) and value >= 1.0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 1 (the risk-ranked regime), got {text!r}")
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
    """A file path that can be written: its directory exists and takes a new file, and it is not a directory."""
    path = Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a file path")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"directory {str(parent)!r} of {text!r} does not exist")
    try:
        _probe_writable(parent)
    except OSError as err:
        raise argparse.ArgumentTypeError(f"directory {str(parent)!r} of {text!r} is not writable "
                                         f"({err.strerror or err})") from None
    return path


def output_dir(text: str) -> Path:
    """A directory path to create or reuse: not an existing file (created by :func:`prepare_output_dir`)."""
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not a directory")
    return path


def prepare_output_dir(path: Path, option: str = "--out") -> Path:
    """Create ``path`` (and its parents) and check a file can be written in it: before any work starts.

    Raises ``ValueError`` naming ``option`` when it cannot be created or written (a file in the
    way, no permission, a read-only file system).
    """
    try:
        path.mkdir(parents=True, exist_ok=True)
        _probe_writable(path)
    except OSError as err:
        raise ValueError(f"{option} {str(path)!r}: cannot write a report there ({err.strerror or err})") from None
    return path


def check_output_dir(path: Path, option: str = "--out") -> Path:
    """The cheap half of :func:`prepare_output_dir`, run first: ``path``'s nearest existing ancestor takes files.

    Nothing is created, so a later argument error leaves no empty directory behind.
    """
    ancestor = path.absolute()
    while not ancestor.exists():
        ancestor = ancestor.parent
    try:
        if not ancestor.is_dir():
            raise NotADirectoryError(20, "Not a directory", str(ancestor))
        _probe_writable(ancestor)
    except OSError as err:
        raise ValueError(f"{option} {str(path)!r}: cannot write a report there ({err.strerror or err})") from None
    return path


def _probe_writable(directory: Path) -> None:
    # Create and delete a file: os.access answers yes for root on a read-only file system.
    with tempfile.TemporaryFile(dir=directory):
        pass


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
