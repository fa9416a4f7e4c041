"""A user's own model: "path/to/file.py:factory" (the file imported, the factory called) or a Hugging Face
`from_pretrained` directory (its config.json, built with `AutoModelForCausalLM.from_config`). Every mistake
(a missing file, a syntax error, a factory that raises or returns something other than an nn.Module) is one
ValueError / FileNotFoundError line. Planning (search.api) and execution (execute.source) both load through here.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from autoplan.models.specs import is_file_spec, is_hf_dir


def import_factory(spec: str) -> Callable[[], Any]:
    """The callable named by "path/to/file.py:factory"."""
    path, name = spec.rsplit(":", 1)
    if not Path(path).is_file():
        raise FileNotFoundError(f"model file {path!r} not found")
    module_spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"model file {path!r} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except SyntaxError as exc:
        raise ValueError(f"model file {path} has a syntax error at line {exc.lineno}: {exc.msg}") from None
    except Exception as exc:  # noqa: BLE001 - whatever the user's file raises becomes one line
        raise ValueError(f"importing model file {path} failed: {type(exc).__name__}: {exc}") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ValueError(f"{path} has no callable {name!r}: name a function that returns an nn.Module")
    return factory


def call_factory(spec: str) -> nn.Module:
    """factory() for "file.py:factory", checked to be an nn.Module (call it under the device context wanted)."""
    factory = import_factory(spec)
    try:
        model = factory()
    except Exception as exc:  # noqa: BLE001 - one line, not the user's traceback
        raise ValueError(f"{spec}() raised {type(exc).__name__}: {exc}") from None
    if not isinstance(model, nn.Module):
        raise ValueError(f"{spec}() returned {type(model).__name__}, not an nn.Module: return the model itself")
    return model


def hf_from_dir(path: str) -> nn.Module:
    """The causal LM a from_pretrained directory describes, built from its config (weights are not read)."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise ValueError(f"{path} is a Hugging Face model directory: install transformers to use it") from None
    try:
        config = AutoConfig.from_pretrained(path)
        return AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, OSError) as exc:
        raise ValueError(f"cannot build a causal LM from {path}/config.json: {exc}") from None


def model_name_of(spec: str) -> str:
    """A short name for reports: the preset, the factory file's stem, or the directory's name."""
    if is_file_spec(spec):
        return Path(spec.rsplit(":", 1)[0]).stem
    if is_hf_dir(spec):
        return Path(spec).resolve().name
    return spec


__all__ = ["call_factory", "hf_from_dir", "import_factory", "is_file_spec", "is_hf_dir", "model_name_of"]
