"""CaptureError: a model torch.export and fx cannot trace, described in one line (module, op, fix)."""

from __future__ import annotations

import linecache
import os
from types import TracebackType

import torch
from torch import nn

_TORCH_DIR = os.path.dirname(torch.__file__)


class CaptureError(ValueError):
    """The model could not be traced; the message names the module, the failing line and what to change."""


def describe_failure(exc: BaseException, model: nn.Module) -> str:
    paths = {id(m): (p or "<root>", type(m).__name__) for p, m in model.named_modules()}
    module, where = ("<root>", type(model).__name__), ""
    for tb in _tracebacks(exc):
        while tb is not None:
            frame = tb.tb_frame
            owner = frame.f_locals.get("self")
            if owner is not None and id(owner) in paths:
                module = paths[id(owner)]
            if not frame.f_code.co_filename.startswith(_TORCH_DIR):
                line = linecache.getline(frame.f_code.co_filename, tb.tb_lineno).strip()
                where = f"`{line}` ({os.path.basename(frame.f_code.co_filename)}:{tb.tb_lineno})"
            tb = tb.tb_next
    reason = _reason(exc)
    data_dependent = (
        "data-dependent" in reason
        or "data dependent" in reason
        or "GuardOnDataDependent" in (type(exc).__name__ + reason)
    )
    if data_dependent:
        advice = "replace Python control flow on tensor values with torch.where / torch.cond, or branch on shapes only"
    elif "more than 1 value per channel" in reason:  # torch.nn.functional._verify_batch_size: BatchNorm in training
        advice = ("the traced input is too small for this model: after its downsampling a BatchNorm sees one value "
                  "per channel; pass a larger seq_len (--seq-len: a vision model's first-layer patches, e.g. 12544 "
                  "for ResNet-50 at 224 px, 196 for ViT-B/16) or example_inputs= of the real size")
    else:
        advice = ("make the forward traceable by torch.export (strict=False) or pass example_inputs= that "
                  "match its signature")
    return (
        f"cannot capture module '{module[0]}' ({module[1]}): op {where or '<unknown>'} failed: "
        f"{reason}; {advice}"
    )


def _tracebacks(exc: BaseException) -> list[TracebackType | None]:
    chain: list[BaseException] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append(current)
        current = current.__cause__ or current.__context__
    return [e.__traceback__ for e in reversed(chain)]


def _reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    if "data-dependent" in text or "data dependent" in text or "GuardOnDataDependent" in type(exc).__name__:
        first = text.split(".")[0]
        return f"data-dependent expression ({first[:120]})"
    return f"{type(exc).__name__}: {text[:160]}"
