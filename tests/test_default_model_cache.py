"""Where the default model's safetensors copy lives (``cache_dir``): oracle = the documented rule.

``$WITCERT_CACHE`` when set; else ``models/`` of the source checkout (an editable install runs from
one); a regular install falls back to ``~/.cache/witcert`` (checked by the fresh-install script).
"""
from pathlib import Path

from witcert.integrations.hf.default_model import cache_dir

CHECKOUT = Path(__file__).resolve().parents[1]


def test_the_environment_variable_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("WITCERT_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path


def test_a_checkout_keeps_the_copy_in_its_models_folder(monkeypatch):
    monkeypatch.delenv("WITCERT_CACHE", raising=False)
    assert cache_dir() == CHECKOUT / "models"
