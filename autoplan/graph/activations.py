"""Activation bytes saved for backward, measured by replaying the captured graph under autograd on fake
tensors (FakeTensorMode: shapes only, no memory) with torch.autograd.graph.saved_tensors_hooks.

Each tensor autograd saves is charged to the graph node that ran when it was saved, once per storage
(storage, offset, numel), skipping parameters and tensors that do not depend on the model input.
Fused attention ops are charged FlashAttention-style (Dao et al. 2022): q, k, v, the output and the
fp32 log-sum-exp, never the s x s scores, whatever kernel the CPU fake run picks. Saved tensors whose
last two dims are (seq_len, seq_len) are the attention-scores part that selective recompute drops
(Korthikanti et al. 2022, the 5 a s / h term).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from autoplan.graph import ops
from autoplan.graph.layers import Taint

Saved = dict[str, list[tuple[Any, int, bool]]]


def saved_for_backward(ep: ExportedProgram, taint: Taint, seq_len: int, microbatch: int) -> tuple[Saved, str]:
    """Node name -> [(storage key, bytes, is attention scores)] of the tensors it saves for backward;
    and a note when the replay failed and the static rule was used instead ("" otherwise)."""
    try:
        return _replay(ep, taint, seq_len, microbatch), ""
    except Exception as exc:  # noqa: BLE001 - e.g. an op without a fake kernel: use the static rule
        note = f"activation bytes estimated statically (autograd replay failed: {type(exc).__name__}: {exc})"
        return _static_estimate(ep.graph, taint, seq_len, microbatch), note[:200]


def is_scores(shape: tuple[int, ...], seq_len: int, microbatch: int) -> bool:
    """[b, heads, s, s] or [b heads, s, s] with s >= seq_len (a class token may add one)."""
    if len(shape) < 3 or shape[-1] != shape[-2] or shape[-1] < seq_len:
        return False
    return len(shape) >= 4 or shape[0] > microbatch


def _replay(ep: ExportedProgram, taint: Taint, seq_len: int, microbatch: int) -> Saved:
    trainable = {s.arg.name for s in ep.graph_signature.input_specs if s.kind is InputKind.PARAMETER}
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
    recorder = _Recorder(ep.graph_module, taint, seq_len, microbatch)
    with mode:
        inputs = [_fake_input(n, n.name in trainable) for n in ep.graph.nodes if n.op == "placeholder"]
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t):
            recorder.run(*inputs)
    return recorder.saved


def _fake_input(node: fx.Node, trainable: bool) -> Any:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return val
    shape = [int(d) for d in val.shape]
    stride = [int(d) for d in val.stride()]
    t = torch.empty_strided(shape, stride, dtype=val.dtype, device=val.device)
    return t.requires_grad_(trainable and t.is_floating_point())


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, taint: Taint, seq_len: int, microbatch: int) -> None:
        super().__init__(gm)
        self.taint, self.seq_len, self.microbatch = taint, seq_len, microbatch
        self.saved: Saved = {}
        self.current: fx.Node | None = None
        self.owner: dict[int, fx.Node] = {}  # storage id -> node that produced it
        self.keep: list[torch.Tensor] = []  # hold every tensor so storage ids are never reused

    def run_node(self, n: fx.Node) -> Any:
        self.current = n
        out = super().run_node(n)
        for t in ops.tensors(out):
            self.owner.setdefault(t.untyped_storage()._cdata, n)
            self.keep.append(t)
        if ops.is_attention(n.target):
            q, k, v = (self.env[a] for a in n.args[:3])
            self.current = None
            for t in (q, k, v, *ops.tensors(out)):
                self._record(n, t, scores_possible=False)
            lse = math.prod(q.shape[:-1]) * 4  # fp32 log-sum-exp per query row
            self.saved.setdefault(n.name, []).append((("lse", n.name), lse, False))
        return out

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        node = self.current
        if node is not None and not ops.is_attention(node.target):
            self._record(node, t)
        return t

    def _record(self, node: fx.Node, t: torch.Tensor, scores_possible: bool = True) -> None:
        storage = t.untyped_storage()._cdata
        producer = self.owner.get(storage)
        if producer is not None and producer not in self.taint.activation:
            return  # a parameter, buffer or input-independent constant
        self.keep.append(t)
        scores = scores_possible and is_scores(tuple(t.shape), self.seq_len, self.microbatch)
        key = (storage, t.storage_offset(), t.numel())
        self.saved.setdefault(node.name, []).append((key, t.numel() * t.element_size(), scores))


def _static_estimate(graph: fx.Graph, taint: Taint, seq_len: int, microbatch: int) -> Saved:
    """Fallback when the replay fails: the activation inputs of every matmul, attention, norm and
    nonlinearity (what their backward formulas read)."""
    saved: Saved = {}
    for node in graph.nodes:
        if node.op != "call_function" or ops.classify(ops.op_name(node.target)) == "view":
            continue
        if ops.op_name(node.target) in {"add", "sub", "to", "_to_copy", "cat", "clone", "contiguous"}:
            continue
        for arg in node.all_input_nodes:
            val = arg.meta.get("val")
            if arg in taint.activation and isinstance(val, torch.Tensor) and val.is_floating_point():
                size = math.prod(int(d) for d in val.shape) * val.element_size()
                scores = is_scores(tuple(int(d) for d in val.shape), seq_len, microbatch)
                saved.setdefault(node.name, []).append((arg.name, size, scores))
    return saved
