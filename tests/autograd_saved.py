"""The tensors an autograd graph saved for its backward, found by walking it from an output's grad_fn: the
one walker behind tests/unit/test_cost_saved_tensors.py (one process) and tests/dist/test_exec_saved.py
(DTensor ranks)."""

from __future__ import annotations

from collections.abc import Iterator

import torch


def saved_tensors(out: torch.Tensor) -> Iterator[tuple[object, str, torch.Tensor]]:
    """(node, attribute, tensor) of every tensor in a `_saved_*` attribute of the nodes behind `out`, once per node."""
    seen, stack = set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for name in dir(node):
            if not name.startswith("_saved_"):
                continue
            try:
                value = getattr(node, name)
            except (RuntimeError, AttributeError):
                continue
            for t in value if isinstance(value, (tuple, list)) else [value]:
                if isinstance(t, torch.Tensor):
                    yield node, name, t
        stack.extend(nxt for nxt, _ in node.next_functions)
