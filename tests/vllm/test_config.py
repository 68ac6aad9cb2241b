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
