"""What a model spec string names, told without importing torch: a "path/to/file.py:factory", a Hugging Face
model directory, or else a preset's name; and which presets have components (autoplan.models.multimodal's
MULTIMODAL_PRESETS, whose keys a test holds equal to MULTIMODAL_NAMES)."""

from __future__ import annotations

from pathlib import Path

MULTIMODAL_NAMES = ("tiny-llava", "llava-1.5-7b", "tiny-policy")


def is_file_spec(spec: str) -> bool:
    return ":" in spec and spec.rsplit(":", 1)[0].endswith(".py")


def is_hf_dir(spec: str) -> bool:
    return Path(spec).is_dir() and (Path(spec) / "config.json").is_file()
