"""The ``witcert`` command: arguments checked before any model load, defaults in ``--help``, plugins.

Implementations under test: ``witcert.cli`` (``main``, the ``observe``/``fuzz``/``schemes``
subcommands) and ``witcert.schemes.plugins`` (``module:function`` specs, the ``witcert.schemes``
entry-point group). Oracles: the exit status (2 for a bad argument, as argparse), the error text
naming the argument, and the fact that neither the model loader ran nor transformers was
imported when a bad argument was rejected; for the plugin run on the real model, the true TV of
every cell against the exact shadow (per cell, no tolerance). Domain: typos and out-of-range
values of every checked argument; local and installed plugin schemes, good and broken.
"""
import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from witcert.cli import EXIT_SIGPIPE, main
from witcert.integrations.hf import default_model
from witcert.schemes import plugins
from witcert.schemes.registry import _REGISTRY

PLUGIN_SOURCE = '''
import torch


def halve_error(x):
    """Toy plugin: round to a 1/64 grid (the reconstruction a user-written scheme returns)."""
    return torch.round(x * 64) / 64


class Packed(torch.Tensor):
    """A QTensor-like wrapper: packed codes behind the float shape and dtype."""

    @staticmethod
    def __new__(cls, x):
        return torch.Tensor._make_wrapper_subclass(cls, x.shape, dtype=x.dtype, device=x.device)

    def __init__(self, x):
        self._codes = torch.round(x * 64).to(torch.int16)

    def dequantize(self):
        return self._codes.to(self.dtype) / 64

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(str(func))


def packed(x):
    """Forgets to dequantize."""
    return Packed(x)


NOT_CALLABLE = 3
'''


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """A user's working directory holding ``my_schemes.py``; the specs it registers are removed after."""
    (tmp_path / "my_schemes.py").write_text(PLUGIN_SOURCE)
    monkeypatch.chdir(tmp_path)
    before = set(_REGISTRY)
    yield tmp_path
    sys.modules.pop("my_schemes", None)
    for name in set(_REGISTRY) - before:
        _REGISTRY.pop(name)


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if any path reaches the model loader."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model loader ran before the arguments were rejected")

    monkeypatch.setattr(default_model, "load_model", refuse)


def _exit_status(argv, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    return exc.value.code, capsys.readouterr().err


# ------------------------------------------------------------------------- bad arguments -> exit 2


@pytest.mark.parametrize("argv,message", [
    (["observe", "--scheme", "rtn-int9"], r"unknown scheme 'rtn-int9'; registered schemes: .*rtn-int8.*module:function"),
    (["observe", "--scheme", "rtn-int4,,fp8-e4m4"], r"unknown scheme 'fp8-e4m4'"),
    (["observe", "--scheme", ","], r"--scheme: give at least one scheme"),
    (["observe", "--task", "no/such/notes.txt"], r"--task 'no/such/notes.txt' is neither needle \| text \| code"),
    (["observe", "--model", "no/such/checkpoint"], r"argument --model: no such file or directory"),
    (["observe", "--tau", "1"], r"argument --tau: tau must lie strictly between 0 and 1"),
    (["observe", "--tau", "nan"], r"argument --tau: tau must lie strictly between 0 and 1"),
    (["observe", "--tau", "0.2x"], r"argument --tau: must be a number in \(0, 1\)"),
    (["observe", "--context", "0"], r"argument --context: must be a positive integer, got '0'"),
    (["observe", "--cases", "two"], r"argument --cases: must be an integer, got 'two'"),
    (["observe", "--threads", "-1"], r"argument --threads: must be a positive integer"),
    (["observe", "--seed", str(2**64)], r"argument --seed: must be an integer in \[0, 2\^64\)"),
    (["observe", "--tier", "C"], r"argument --tier: invalid choice: 'C'"),
    (["observe", "--tier", "B", "--scheme", "rtn-int8"], r"--tier B certifies the dithered-int8 cache only"),
    (["fuzz", "--trials", "0"], r"argument --trials: must be a positive integer"),
    (["fuzz", "--seed", "-3"], r"argument --seed: must be an integer >= 0"),
    (["fuzz", "--json", "no/such/dir/report.json"], r"argument --json: directory 'no/such/dir' .* does not exist"),
])
def test_a_bad_argument_exits_2_with_its_name_before_any_work(argv, message, capsys, no_model_load, monkeypatch,
                                                                tmp_path):
    monkeypatch.chdir(tmp_path)  # the relative paths above do not exist here
    status, err = _exit_status(argv, capsys)
    assert status == 2
    assert re.search(message, err), err


@pytest.mark.parametrize("argv,missing,extra", [
    (["observe"], "matplotlib", "observatory"),
    (["fuzz"], "triton", "verify"),
])
def test_a_missing_extra_is_named_before_any_work(argv, missing, extra, capsys, no_model_load, monkeypatch):
    from witcert.cli import _args

    real = _args.importlib.util.find_spec
    monkeypatch.setattr(_args.importlib.util, "find_spec", lambda name, *a: None if name == missing else real(name, *a))
    status, err = _exit_status(argv, capsys)
    assert status == 2 and f"needs {missing}, which is not installed: pip install 'witcert[{extra}]'" in err


def test_model_path_must_be_a_checkpoint(capsys, no_model_load, tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0")
    status, err = _exit_status(["observe", "--model", str(tmp_path)], capsys)
    assert status == 2 and "directory without config.json" in err
    status, err = _exit_status(["observe", "--model", str(tmp_path / "weights.bin")], capsys)
    assert status == 2 and "neither a checkpoint directory nor a .gguf file" in err
    (tmp_path / "config.json").write_text('{"hidden_size": 576, "num_attention_heads": 9}')
    status, err = _exit_status(["observe", "--model", str(tmp_path), "--bands", "6"], capsys)
    assert status == 2 and "--bands 6 must divide head_dim/2 = 32" in err


def test_a_typo_is_rejected_without_importing_transformers():
    """Oracle: ``sys.modules`` of a fresh interpreter; what keeps the rejection quick is importing nothing heavy."""
    probe = ("import sys\nfrom witcert.cli import main\n"
             "try:\n    main(['observe', '--scheme', 'rtn-int44'])\nexcept SystemExit as e:\n    code = e.code\n"
             "print(code, 'transformers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.stdout.split() == ["2", "False"], done.stdout + done.stderr
    assert "unknown scheme 'rtn-int44'" in done.stderr


# ------------------------------------------------------------------------- help shows defaults


def test_help_shows_every_default(capsys):
    for argv, defaults in ((["observe", "--help"], ["(default: 0.2)", "(default: 512)", "(default: needle)",
                                                    "(default: auto)", "(default: 16)", "(default: rtn-int4;"]),
                           (["fuzz", "--help"], ["(default: 50000)", "(default: 0)"])):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
        assert exc.value.code == 0
        for default in defaults:
            assert default in out, (argv, default)
        assert "(default: None)" not in out and "(default: False)" not in out


# ------------------------------------------------------------------------- plugins


def test_module_function_scheme_is_loaded_probed_and_registered(plugin_dir):
    assert plugins.resolve_scheme("my_schemes:halve_error") == "my_schemes:halve_error"
    assert "my_schemes:halve_error" in _REGISTRY
    assert plugins.resolve_scheme("rtn-int8") == "rtn-int8"  # registered names pass through


@pytest.mark.parametrize("spec,message", [
    ("my_schemes:packed", r"tensor subclass .*Packed.*call \.dequantize\(\) on it and return that"),
    ("my_schemes:missing", r"'my_schemes' has no attribute 'missing'"),
    ("my_schemes:NOT_CALLABLE", r"is a int, not a callable"),
    ("no_such_module:fn", r"no module named 'no_such_module'"),
])
def test_a_broken_plugin_is_rejected_before_the_model_loads(spec, message, plugin_dir, capsys, no_model_load):
    status, err = _exit_status(["observe", "--scheme", spec], capsys)
    assert status == 2
    assert re.search(message, err), err
    assert spec not in _REGISTRY


@pytest.fixture
def installed_plugin(tmp_path, monkeypatch):
    """A distribution on sys.path declaring ``fake-round`` in the ``witcert.schemes`` entry-point group."""
    (tmp_path / "fake_plugin.py").write_text(PLUGIN_SOURCE)
    info = tmp_path / "fake_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[witcert.schemes]\nfake-round = fake_plugin:halve_error\n"
                                           "fake-packed = fake_plugin:packed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("fake_plugin", None)
    for name in ("fake-round", "fake-packed"):
        _REGISTRY.pop(name, None)


def test_entry_point_plugins_are_listed_without_loading_and_load_when_named(installed_plugin, capsys):
    assert main(["schemes"]) == 0
    out = capsys.readouterr().out
    assert "fake-round" in out and "plugin fake_plugin:halve_error (loaded when used)" in out
    assert "fake_plugin" not in sys.modules  # listing imports no plugin
    assert plugins.resolve_scheme("fake-round") == "fake-round"
    with pytest.raises(plugins.SchemeLoadError, match="tensor subclass"):
        plugins.resolve_scheme("fake-packed")
    with pytest.raises(plugins.SchemeLoadError, match="installed plugins: fake-packed, fake-round"):
        plugins.resolve_scheme("fake-rnd")


# ------------------------------------------------------------------------- output pipe


def test_a_closed_output_pipe_ends_quietly():
    """``witcert schemes | true``: the reader is gone before anything is written."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; from witcert.cli import main; sys.exit(main(['schemes']))"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    child.stdout.close()
    _, err = child.communicate(timeout=300)
    assert b"Traceback" not in err and b"BrokenPipeError" not in err, err.decode()
    assert child.returncode == EXIT_SIGPIPE


# ------------------------------------------------------------------------- a plugin on the real model


@pytest.mark.model
def test_a_user_scheme_runs_in_observe_and_every_cell_is_sound(plugin_dir, tmp_path):
    """Oracle: true TV against the exact shadow, per cell, from the run's own telemetry (no tolerance)."""
    threads = torch.get_num_threads()
    try:
        status = main(["observe", "--scheme", "my_schemes:halve_error", "--task", "text", "--cases", "1",
                       "--context", "160", "--probe", "8", "--out", str(tmp_path / "report")])
    finally:
        torch.set_num_threads(threads)
    assert status == 0
    rows = [json.loads(line) for line in (tmp_path / "report" / "telemetry.jsonl").read_text().splitlines()]
    assert rows and {r["scheme"] for r in rows} == {"my_schemes:halve_error"}
    assert {r["tier"] for r in rows} == {"A"}  # the tier used, not the --tier option's "auto"
    tv, meter = np.array([r["true_tv"] for r in rows]), np.array([r["meter"] for r in rows])
    assert not np.isnan(tv).any() and (tv <= meter).all()
