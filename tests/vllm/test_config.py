"""The plugin's switches: off by default, clear errors naming the variable (no vLLM needed)."""
import pytest

from witcert.integrations.vllm import config, register


def test_off_by_default_and_register_does_nothing(monkeypatch):
    monkeypatch.delenv(config.ENABLE, raising=False)
    assert config.PluginConfig.from_env().enabled is False
    register()  # must not import vLLM (it is not installed in the main venv)


@pytest.mark.parametrize("env,match", [({"WITCERT_VLLM": "maybe"}, "WITCERT_VLLM must be"),
                                       ({"WITCERT_VLLM_BANDS": "x"}, "WITCERT_VLLM_BANDS must be an integer"),
                                       ({"WITCERT_VLLM_BANDS": "0"}, "WITCERT_VLLM_BANDS must be a positive"),
                                       ({"WITCERT_VLLM_TAU": "1.5"}, "WITCERT_VLLM_TAU must be in"),
                                       ({"WITCERT_VLLM_TAU": "abc"}, "WITCERT_VLLM_TAU must be a number")])
def test_bad_values_name_the_variable(env, match):
    with pytest.raises(ValueError, match=match):
        config.PluginConfig.from_env(env)


def test_reads_every_switch():
    cfg = config.PluginConfig.from_env({"WITCERT_VLLM": "1", "WITCERT_VLLM_BANDS": "8", "WITCERT_VLLM_TAU": "0.05",
                                        "WITCERT_VLLM_JSONL": "/tmp/x", "WITCERT_VLLM_SHADOW": "true"})
    assert (cfg.enabled, cfg.bands, cfg.tau, cfg.jsonl, cfg.shadow) == (True, 8, 0.05, "/tmp/x", True)


def test_scheme_gate_switches_and_the_schemes_a_request_may_choose():
    cfg = config.PluginConfig.from_env({"WITCERT_VLLM_SCHEME": "rtn-int8", "WITCERT_VLLM_SCHEMES": " kivi-2bit, rtn-int4,",
                                        "WITCERT_VLLM_GATE": "1", "WITCERT_VLLM_GATE_BLOCK": "32"})
    assert (cfg.scheme, cfg.schemes, cfg.gate, cfg.gate_block) == ("rtn-int8", ("kivi-2bit", "rtn-int4"), True, 32)
    assert cfg.allowed_schemes == ("rtn-int8", "kivi-2bit", "rtn-int4", "none")
    default = config.PluginConfig.from_env({})
    assert (default.scheme, default.schemes, default.gate, default.allowed_schemes) == ("none", (), False, ("none",))


@pytest.mark.parametrize("env,match", [({"WITCERT_VLLM_GATE": "sometimes"}, "WITCERT_VLLM_GATE must be"),
                                       ({"WITCERT_VLLM_GATE_BLOCK": "0"}, "WITCERT_VLLM_GATE_BLOCK must be a positive"),
                                       ({"WITCERT_VLLM_GATE_BLOCK": "1.5"}, "WITCERT_VLLM_GATE_BLOCK must be an integer")])
def test_bad_gate_switches_name_the_variable(env, match):
    with pytest.raises(ValueError, match=match):
        config.PluginConfig.from_env(env)


def test_request_settings_follow_extra_args_within_what_the_operator_loaded():
    cfg = config.PluginConfig.from_env({"WITCERT_VLLM_SCHEME": "rtn-int8", "WITCERT_VLLM_SCHEMES": "kivi-2bit",
                                        "WITCERT_VLLM_GATE": "1"})
    assert config.request_settings(cfg, None) == config.RequestSettings("rtn-int8", True)
    assert config.request_settings(cfg, {"witcert_scheme": "kivi-2bit", "witcert_gate": False}) == \
        config.RequestSettings("kivi-2bit", False)
    assert config.request_settings(cfg, {"witcert_scheme": "none", "witcert_gate": 0}).gate is False
    assert config.request_settings(cfg, {"witcert_gate": "true", "other": 1}).gate is True
    with pytest.raises(ValueError, match=r"witcert_scheme='rtn-int4' is not a scheme this engine loaded; "
                                         r"choose one of rtn-int8, kivi-2bit, none"):
        config.request_settings(cfg, {"witcert_scheme": "rtn-int4"})
    with pytest.raises(ValueError, match="witcert_scheme"):
        config.request_settings(cfg, {"witcert_scheme": "os:system"})  # a request never names code to load
    with pytest.raises(ValueError, match="witcert_gate must be true or false, got 2"):
        config.request_settings(cfg, {"witcert_gate": 2})
    no_gate = config.PluginConfig.from_env({})
    with pytest.raises(ValueError, match="witcert_gate=true needs an engine started with WITCERT_VLLM_GATE=1"):
        config.request_settings(no_gate, {"witcert_gate": True})


def test_meter_layers_none_meters_no_layer_and_bad_layers_name_the_key():
    from witcert.integrations.vllm import sampling

    nothing = sampling.metering_of(None, None, " None ", None)
    assert nothing.layers == frozenset() and not nothing.everything
    assert not any(nothing.meters(layer, position) for layer in range(4) for position in (0, 4, 700))
    assert sampling.metering_of(None, None, "", None).everything
    with pytest.raises(ValueError, match=r"witcert_meter_layers must name layer indices .*'none'"):
        sampling.parse_layers("nothing")
