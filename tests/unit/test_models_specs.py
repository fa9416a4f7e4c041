"""autoplan.models.specs tells specs apart without torch, and agrees with the modules that build the models."""

from __future__ import annotations

from pathlib import Path

from autoplan.models.multimodal import MULTIMODAL_PRESETS
from autoplan.models.specs import MULTIMODAL_NAMES, is_file_spec, is_hf_dir


def test_the_multimodal_names_are_the_multimodal_presets() -> None:
    assert sorted(MULTIMODAL_NAMES) == sorted(MULTIMODAL_PRESETS)


def test_file_specs_and_model_directories(tmp_path: Path) -> None:
    assert is_file_spec("my/model.py:build") and not is_file_spec("gpt3-175b") and not is_file_spec("a.txt:b")
    assert not is_hf_dir(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert is_hf_dir(str(tmp_path))


def test_every_lazy_name_is_exported_and_resolves() -> None:
    """autoplan.models lists its names twice (ruff wants __all__ as a literal): the lazy table and __all__
    must agree, and each name must resolve to the object of the module it names."""
    import importlib

    from autoplan import models

    assert sorted(models.__all__) == sorted(models._HOME)
    for name, home in models._HOME.items():
        assert getattr(models, name) is getattr(importlib.import_module(f"autoplan.models.{home}"), name)
