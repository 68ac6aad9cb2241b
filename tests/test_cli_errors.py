"""Errors before work: every bad argument of ``witcert`` and ``witcert.monitor`` is refused before a model loads.

Implementations under test: ``witcert.cli`` (``main`` and its exit statuses, ``witcert.cli._exit``),
``witcert.cli._args`` (``certified_tau``, ``risk_threshold``, ``prepare_output_dir``,
``context_too_small``), ``witcert.schemes.catalog.unknown_scheme_message``,
``witcert.core.thresholds.check_certified_tau``, ``witcert.integrations.hf.geometry.has_rope`` and
``MemoryReport`` of ``witcert.integrations.hf.monitoring``.
Oracles: the exit status (the table of ``witcert.cli._exit``), the message naming the argument in
the command's own spelling, the absence of a traceback, and a model loader that fails the test if
it is reached; for a model without RoPE, the true TV of every cell against the exact shadow.
Domain: each checked argument of ``observe``, ``study`` and ``fuzz``, run failures of each kind,
and the keyword arguments of ``witcert.monitor``.
"""
import re

import pytest
import torch

import witcert
from witcert.cli import _exit, main, schemes as schemes_command
from witcert.core.thresholds import check_certified_tau
from witcert.schemes.catalog import CACHE_SCHEMES, unknown_scheme_message
from witcert.schemes.registry import list_schemes
from tests.test_cli import _exit_status as _rejected, no_model_load  # noqa: F401  (a fixture)
from tests.tiny_models import prompts, tiny


def _unwritable(tmp_path):
    """A directory path nothing can create, even as root: a regular file stands where a directory would be."""
    (tmp_path / "a-file").write_text("")
    return str(tmp_path / "a-file" / "report")


# ------------------------------------------------------------------------- usage errors: exit 2


@pytest.mark.parametrize("argv,message", [
    (["observe", "--tau", "2"], r"argument --tau: tau must lie strictly between 0 and 1"),
    (["observe", "--tau", "0"], r"argument --tau: tau must lie strictly between 0 and 1"),
    (["study", "--tau", "1.5"], r"argument --tau: tau must lie strictly between 0 and 1"),
    (["study", "--risk-tau", "0.5"], r"argument --risk-tau: must be a finite number >= 1"),
    (["study", "--risk-tau", "inf"], r"argument --risk-tau: must be a finite number >= 1"),
    (["study", "--scheme", "dithered-int8"], r"--scheme: dithered-int8 is a cache, which `witcert observe` meters"),
    (["study", "--cases", "2", "--sweep-cases", "3"], r"--sweep-cases 3 must not exceed --cases 2"),
    (["study", "--scheme", "fp8-e4m3", "--gate-scheme", "rtn-int4", "--risk-scheme", "", "--sweep-scheme", ""],
     r"--gate-scheme: rtn-int4 must also be in --scheme"),
    (["study", "--scheme", "", "--sweep-scheme", ""], r"--scheme: give at least one scheme"),
])
def test_a_bad_argument_exits_2_in_the_commands_own_names(argv, message, capsys, no_model_load):
    status, err = _rejected(argv, capsys)
    assert status == _exit.EXIT_USAGE
    assert re.search(message, err), err
    assert "Traceback" not in err


@pytest.mark.parametrize("command", ["observe", "study"])
def test_an_unknown_scheme_lists_everything_witcert_schemes_lists(command, capsys, no_model_load):
    assert schemes_command.run(type("Args", (), {"names": True})()) == 0
    listed = capsys.readouterr().out.split()
    status, err = _rejected([command, "--scheme", "rtn-int9"], capsys)
    assert status == _exit.EXIT_USAGE and "unknown scheme 'rtn-int9'" in err
    message = " ".join(err.split())  # argparse may wrap
    missing = [name for name in listed if name not in message]
    assert not missing, missing
    assert {"dithered-int8", "hf-quanto-int4"} <= set(listed)


def test_the_library_names_the_same_schemes():
    message = unknown_scheme_message("nope")
    assert all(name in message for name in [*list_schemes(), *CACHE_SCHEMES])
    with pytest.raises(ValueError, match="caches: dithered-int8, hf-quanto-int2"):
        witcert.monitor(tiny("llama"), "nope")


def test_observe_refuses_a_checkpoint_without_rope_before_the_model(capsys, no_model_load, tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2}')
    status, err = _rejected(["observe", "--model", str(tmp_path)], capsys)
    assert status == _exit.EXIT_USAGE
    assert "has no rotary position embedding (RoPE)" in " ".join(err.split())


def test_fuzz_json_into_a_directory_that_is_a_file(capsys, tmp_path):
    status, err = _rejected(["fuzz", "--json", _unwritable(tmp_path) + ".json"], capsys)
    assert status == _exit.EXIT_USAGE and "argument --json: directory" in err and "does not exist" in err


def test_study_out_that_cannot_be_created_is_refused_before_the_model(capsys, no_model_load, tmp_path):
    target = _unwritable(tmp_path)
    status, err = _rejected(["study", "--quick", "--out", target], capsys)
    assert status == _exit.EXIT_USAGE
    assert f"--out {target!r}: cannot write a report there" in err


def test_observe_out_that_cannot_be_created_is_refused_before_the_model(capsys, no_model_load, tmp_path):
    target = _unwritable(tmp_path)
    status, err = _rejected(["observe", "--cases", "1", "--out", target], capsys)
    assert status == _exit.EXIT_USAGE
    assert f"--out {target!r}: cannot write a report there" in err


def test_a_later_argument_error_leaves_no_out_directory(capsys, no_model_load, tmp_path):
    target = tmp_path / "report"
    status, err = _rejected(["observe", "--scheme", "rtn-int9", "--out", str(target)], capsys)
    assert status == _exit.EXIT_USAGE and not target.exists()


@pytest.mark.model
def test_observe_creates_its_out_directory_before_the_model(capsys, no_model_load, tmp_path):
    """The check creates ``--out`` (parents too); the run then reaches the loader, which fails the run: exit 3."""
    target = tmp_path / "deep" / "report"
    assert main(["observe", "--cases", "1", "--out", str(target)]) == _exit.EXIT_FAILURE
    assert target.is_dir()
    err = capsys.readouterr().err
    assert "the model could not be loaded" in err and "Traceback" not in err


@pytest.mark.model
def test_a_context_too_small_is_refused_before_the_model_with_the_least_that_fits(capsys, no_model_load):
    status, err = _rejected(["observe", "--context", "5"], capsys)
    assert status == _exit.EXIT_USAGE
    found = re.search(r"--context 5 is too small for the needle prompt with this model's tokenizer: "
                      r"give --context (\d+) or more", err)
    assert found, err
    least = int(found.group(1))
    status, err = _rejected(["observe", "--context", str(least - 1)], capsys)
    assert status == _exit.EXIT_USAGE and f"give --context {least} or more" in err  # the bisection's answer is tight


@pytest.mark.model
def test_a_text_shorter_than_context_and_probe_is_refused_before_the_model(capsys, no_model_load, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("a short note " * 20)
    status, err = _rejected(["observe", "--task", str(notes), "--context", "512"], capsys)
    assert status == _exit.EXIT_USAGE
    assert "--context 512 / --probe 32" in err and "notes.txt" in err


@pytest.mark.model
def test_study_context_too_small_is_refused_before_the_model(capsys, no_model_load):
    status, err = _rejected(["study", "--context", "8", "--cases", "2", "--sweep-cases", "0"], capsys)
    assert status == _exit.EXIT_USAGE and re.search(r"--context 8 is too small .* give --context \d+ or more", err)


# ------------------------------------------------------------------------- run failures: 3, bugs: 4, Ctrl-C: 130


@pytest.mark.parametrize("raised,status,message", [
    (PermissionError(13, "Permission denied", "reports/x/report.md"), _exit.EXIT_FAILURE,
     "witcert schemes: error: Permission denied: 'reports/x/report.md'"),
    (MemoryError(), _exit.EXIT_FAILURE, "witcert schemes: error: MemoryError"),
    (KeyboardInterrupt(), _exit.EXIT_INTERRUPTED, "witcert schemes: interrupted"),
])
def test_a_run_failure_is_one_line_and_its_own_status(raised, status, message, capsys, monkeypatch):
    def fail(args):
        raise raised

    monkeypatch.setattr(schemes_command, "run", fail)
    assert main(["schemes"]) == status
    err = capsys.readouterr().err
    assert err.strip() == message and "Traceback" not in err


def test_a_bug_is_status_4_with_its_traceback_never_1(capsys, monkeypatch):
    def fail(args):
        raise RuntimeError("an internal inconsistency")

    monkeypatch.setattr(schemes_command, "run", fail)
    assert main(["schemes"]) == _exit.EXIT_INTERNAL
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError: an internal inconsistency" in err and "internal error" in err


def test_exit_statuses_are_distinct_and_1_is_the_violation():
    statuses = [_exit.EXIT_OK, _exit.EXIT_VIOLATION, _exit.EXIT_USAGE, _exit.EXIT_FAILURE, _exit.EXIT_INTERNAL,
                _exit.EXIT_INTERRUPTED, _exit.EXIT_SIGPIPE]
    assert len(set(statuses)) == len(statuses) and _exit.EXIT_VIOLATION == 1


# ------------------------------------------------------------------------- witcert.monitor arguments


@pytest.mark.parametrize("kwargs,message", [
    (dict(tau=2.0), r"tau must lie strictly between 0 and 1"),
    (dict(tau=1.0), r"tau must lie strictly between 0 and 1"),
    (dict(tau=0.0), r"tau must lie strictly between 0 and 1"),
    (dict(tau=float("nan")), r"tau must lie strictly between 0 and 1"),
    (dict(tau=True), r"tau must be a number"),
    (dict(tau="0.2"), r"tau must be a number"),
    (dict(meter="fast"), r"meter must be 'fused' or 'full'"),
    (dict(tier="C"), r"tier must be one of"),
    (dict(tier="B"), r"tier B certifies the 'dithered-int8' cache only"),
    (dict(gate=0.2), r"gate must be a witcert.Gate or None"),
    (dict(keep_exact=1), r"keep_exact must be a bool"),
    (dict(delta_loc=0.0), r"delta_loc must lie in \(0, 1\)"),
    (dict(seed=-1), r"seed: expected an int in \[0, 2\^64\)"),
    (dict(backing_dir="/tmp"), r"backing_dir is where the production gate and spot check read exact keys from"),
    (dict(bands=5), r"bands=5 must divide head_dim/2=16"),
    (dict(rope="zigzag"), r"rope must be one of"),
])
def test_monitor_rejects_each_bad_argument_by_name_before_the_first_token(kwargs, message):
    model = tiny("llama")
    before = model.config._attn_implementation
    with pytest.raises(ValueError, match=message):
        witcert.monitor(model, "rtn-int4", **kwargs)
    assert model.config._attn_implementation == before  # nothing was installed on the model


def test_one_tau_range_everywhere():
    """The monitor, the observatory's config and the CLI accept and refuse the same thresholds."""
    from witcert.cli._args import certified_tau
    from witcert.observatory.runner import ObserveConfig

    for tau in (1e-9, 0.2, 0.999):
        assert check_certified_tau(tau) == certified_tau(str(tau)) == ObserveConfig(schemes=("rtn-int4",), tau=tau).tau
    for tau in (0.0, 1.0, 2.0, -0.1, float("inf")):
        for accept in (check_certified_tau, lambda t: ObserveConfig(schemes=("rtn-int4",), tau=t)):
            with pytest.raises(ValueError, match="tau must lie strictly between 0 and 1"):
                accept(tau)


def _gpt2():
    import transformers

    config = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=128, n_positions=64,
                                     bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def test_a_model_without_rope_is_recognised_and_then_metered_soundly():
    """Oracle: the true TV of every cell against the exact shadow (the band bound holds for any channel grouping)."""
    model = _gpt2()
    with pytest.raises(ValueError, match="GPT2LMHeadModel has no rotary position embedding .* pass rope='rotate_half'"):
        witcert.monitor(model, "rtn-int4")
    ids, mask = prompts(rows=1, pad=0)
    with torch.no_grad(), witcert.monitor(model, "rtn-int4", rope="rotate_half") as mon:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    table = mon.table()
    assert len(table) > 0 and (table["true_tv"] <= table["meter"]).all()


def test_memory_in_validation_mode_says_what_it_compares():
    model = tiny("llama")
    ids, mask = prompts()
    reports = {}
    for keep_exact in (True, False):
        with torch.no_grad(), witcert.monitor(model, "rtn-int4", keep_exact=keep_exact) as mon:
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
        reports[keep_exact] = str(mon.memory())
    assert re.search(r"saved +n/a +validation mode \(keep_exact=True\)", reports[True])
    assert not re.search(r"-\d+(\.\d+)?%", reports[True])  # no negative saving
    assert re.search(r"saved +[\d,]+ B +\d+\.\d% of the exact cache", reports[False])
