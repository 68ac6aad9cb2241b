"""Where the default model's safetensors copy lives (``cache_dir``): oracle = the documented rule.

``$WITCERT_CACHE`` when set; else ``models/`` of the source checkout (an editable install runs from
one); a regular install falls back to ``~/.cache/witcert`` (checked by the fresh-install script).
"""
from pathlib import Path

import pytest

from witcert.integrations.hf import default_model
from witcert.integrations.hf.default_model import cache_dir

CHECKOUT = Path(__file__).resolve().parents[1]


def test_the_environment_variable_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("WITCERT_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path


def test_a_checkout_keeps_the_copy_in_its_models_folder(monkeypatch):
    monkeypatch.delenv("WITCERT_CACHE", raising=False)
    assert cache_dir() == CHECKOUT / "models"


def test_tokenizer_and_model_read_the_same_files(monkeypatch, tmp_path):
    """``_files`` (shared by ``load_tokenizer`` and ``load_model``): the saved copy when it is there, else the
    package's GGUF file with the copy to write; a path of the user's as given. Oracle: the documented rule."""
    monkeypatch.setenv("WITCERT_CACHE", str(tmp_path))
    copy = tmp_path / default_model._CACHE_SUBDIR
    monkeypatch.setattr(default_model, "default_gguf_path", lambda: tmp_path / "pkg" / "model.gguf")
    assert default_model._files(None) == (tmp_path / "pkg", "model.gguf", copy)
    copy.mkdir()
    (copy / "config.json").write_text("{}")
    assert default_model._files(None) == (copy, None, None)
    gguf = tmp_path / "mine.gguf"
    gguf.write_bytes(b"")
    assert default_model._files(gguf) == (tmp_path, "mine.gguf", None)
    assert default_model._files(copy) == (copy, None, None)
    with pytest.raises(ValueError, match="model: no such path"):
        default_model._files(tmp_path / "missing")
