"""Group the nodes of a captured ATen graph into layers and measure each layer.

Layers follow the module tree: the children of the repeated container (the ModuleList / ModuleDict /
Sequential with the most parameterised children) are the BLOCK layers; the other modules along the
path from that container to the root are merged into one EMBEDDING layer (those running before the
first block, named after the first of them) and one HEAD layer (after the last block, named after the
last: our Transformer's "norm" + "head" is the layer "head", Hugging Face's "model.norm" + "lm_head" is
"lm_head"); `Layer.module_paths` lists every module a layer covers, so a pipeline cut by layer names
keeps the final norm with the head. Parameterless modules fold into the layer that runs before them.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import fx, nn

from autoplan.graph import ops
from autoplan.graph.types import Layer, LayerRole

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
_TOPK_ATTRS = ("top_k", "num_experts_per_tok", "topk", "n_activated_experts", "k")


@dataclass(frozen=True, slots=True)
class Units:
    """The module paths that become layers: `blocks` are the container's children, `others` the
    modules beside the path from the container up to the root."""

    container: str
    blocks: tuple[str, ...]
    others: tuple[str, ...]


def find_units(model: nn.Module) -> Units:
    modules = dict(model.named_modules())
    best, best_score = "", (0, 0, 0)
    for path, module in modules.items():
        if not isinstance(module, _CONTAINERS):
            continue
        kids = [c for c in module.children() if has_params(c)]
        same = max(Counter(type(c) for c in kids).values(), default=0)
        score = (same, len(kids), sum(p.numel() for c in kids for p in c.parameters()))
        if len(kids) >= 2 and score > best_score:
            best, best_score = path, score
    blocks = tuple(_join(best, name) for name, _ in modules[best].named_children())
    others: list[str] = []
    path = best
    while path:
        parent = path.rpartition(".")[0]
        others += [_join(parent, n) for n, _ in modules[parent].named_children() if _join(parent, n) != path]
        path = parent
    return Units(container=best, blocks=blocks, others=tuple(others))


def _join(parent: str, name: str) -> str:
    return f"{parent}.{name}" if parent else name


def has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def node_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    return str(list(stack.values())[-1][0])


def unit_of(path: str, units: set[str]) -> str | None:
    while True:
        if path in units:
            return path
        if not path:
            return None
        path = path.rpartition(".")[0]


@dataclass(slots=True)
class Group:
    """One layer being built: its member module paths and graph nodes in forward order."""

    name: str
    role: LayerRole
    paths: list[str]
    nodes: list[fx.Node] = field(default_factory=list)


def group_nodes(graph: fx.Graph | list[fx.Node], units: Units, model: nn.Module) -> list[Group]:
    """Assign every call_function node to a unit, order units by first use and merge them into layers.
    `graph` may be a list of nodes in forward order (one component's, see components.py)."""
    known = set(units.blocks) | set(units.others)
    by_unit: dict[str, list[fx.Node]] = {}
    pending: list[fx.Node] = []
    current: str | None = None
    for node in graph.nodes if isinstance(graph, fx.Graph) else graph:
        if node.op != "call_function":
            continue
        unit = unit_of(node_path(node), known) or current
        if unit is None:
            pending.append(node)
            continue
        if current is None:
            by_unit[unit] = pending
            pending = []
        by_unit.setdefault(unit, []).append(node)
        current = unit
    if current is None:  # nothing recognisable: one layer for the whole model
        return [Group(name="", role=LayerRole.OTHER, paths=[""], nodes=pending)]
    return _merge(list(by_unit.items()), set(units.blocks), model)


def _merge(ordered: list[tuple[str, list[fx.Node]]], blocks: set[str], model: nn.Module) -> list[Group]:
    modules = dict(model.named_modules())
    block_pos = [i for i, (u, _) in enumerate(ordered) if u in blocks]
    first, last = (block_pos[0], block_pos[-1]) if block_pos else (len(ordered), len(ordered))
    groups: list[Group] = []
    for i, (unit, nodes) in enumerate(ordered):
        if i < first:
            role = LayerRole.EMBEDDING
        elif i > last:
            role = LayerRole.HEAD
        else:
            role = LayerRole.BLOCK if unit in blocks else LayerRole.OTHER
        prev = groups[-1] if groups else None
        same_edge = prev is not None and prev.role is role and role in (LayerRole.EMBEDDING, LayerRole.HEAD)
        if prev is not None and (same_edge or not has_params(modules[unit])):
            prev.paths.append(unit)
            prev.nodes += nodes
            if same_edge and role is LayerRole.HEAD and has_params(modules[unit]):
                prev.name = unit  # the head layer is named after its last parameterised module
        else:
            groups.append(Group(name=unit, role=role, paths=[unit], nodes=list(nodes)))
    return groups


class Hint:
    """Concrete value of a (possibly symbolic) size; unbacked, data-dependent sizes take `unbacked`."""

    def __init__(self) -> None:
        self.unbacked = 1

    def __call__(self, dim: Any) -> int:
        if isinstance(dim, int):
            return dim
        hint = dim.node.hint
        if hint is not None:
            return int(hint)
        return self.unbacked


@dataclass(slots=True)
class Taint:
    """Which nodes carry activations (depend on the user inputs) and which are parameters or views of
    them (a matmul with a parameter operand is a projection; one between two activations is attention)."""

    activation: set[fx.Node]
    param: set[fx.Node]


def taint(graph: fx.Graph, user_inputs: set[str], param_inputs: set[str]) -> Taint:
    act: set[fx.Node] = set()
    par: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            (act if node.name in user_inputs else par if node.name in param_inputs else set()).add(node)
            continue
        inputs = node.all_input_nodes
        if any(n in act for n in inputs):
            act.add(node)
        if (
            inputs
            and inputs[0] in par
            and (
                ops.is_view(node.target)
                or ops.op_name(node.target) in {"index", "_to_copy", "to", "contiguous", "clone", "embedding"}
            )
        ):
            par.add(node)
    return Taint(activation=act, param=par)


def _vals(obj: Any) -> Any:
    if isinstance(obj, fx.Node):
        return obj.meta.get("val")
    if isinstance(obj, (list, tuple)):
        return type(obj)(_vals(o) for o in obj)
    return obj


@dataclass(slots=True)
class Measure:
    matmul: float = 0.0
    attention: float = 0.0
    elementwise: float = 0.0
    expert_matmul: float = 0.0  # matmuls inside routed experts, as traced (replaced analytically)
    bytes_moved: int = 0
    signature: list[tuple] = field(default_factory=list)


def measure(nodes: list[fx.Node], taint_: Taint, hint: Hint, expert_paths: tuple[str, ...]) -> Measure:
    m = Measure()
    for node in nodes:
        name = ops.op_name(node.target)
        kind = ops.classify(name)
        args, out = _vals(node.args), node.meta.get("val")
        outs = list(ops.tensors(out))
        m.signature.append((name, tuple(tuple(hint(d) for d in t.shape) for t in outs)))
        if kind == "view" or not outs:
            continue
        m.bytes_moved += sum(ops.nbytes(t, hint) for t in (*ops.tensors(args), *outs))
        if kind == "attention":
            m.attention += ops.attention_flops(args, hint)
        elif kind == "matmul":
            flops = ops.matmul_flops(name, args, outs[0], hint)
            m.elementwise += ops.bias_flops(name, args, outs[0], hint)
            if any(p == node_path(node) or node_path(node).startswith(p + ".") for p in expert_paths):
                m.expert_matmul += flops
            elif name in {"convolution", "_convolution", "conv1d", "conv2d", "conv3d"} or any(
                n in taint_.param for n in node.all_input_nodes
            ):
                m.matmul += flops
            else:
                m.attention += flops
        else:
            m.elementwise += ops.elementwise_flops(name, args, out, hint)
    return m


def boundary_bytes(nodes: list[fx.Node], taint_: Taint, hint: Hint) -> tuple[int, int]:
    """Bytes of activations entering the layer from outside and leaving it."""
    inside = set(nodes)
    entering = {a for n in nodes for a in n.all_input_nodes if a not in inside and a in taint_.activation}
    leaving = {n for n in nodes if n in taint_.activation and any(u not in inside for u in n.users)}

    def size(ns: set[fx.Node]) -> int:
        return sum(ops.nbytes(t, hint) for n in ns for t in ops.tensors(n.meta.get("val")))

    return size(entering), size(leaving)


def kind_hash(role: LayerRole, signature: list[tuple], params: list[tuple]) -> str:
    text = repr((role.value, signature, params)).encode()
    return hashlib.sha1(text).hexdigest()[:8]


def iter_params(model: nn.Module, paths: list[str]) -> Iterator[tuple[str, nn.Parameter]]:
    """Parameters under the given module paths (tied parameters once, where first registered)."""
    owners = set(paths)
    for fqn, p in model.named_parameters():
        if unit_of(fqn.rpartition(".")[0], owners) is not None:
            yield fqn, p


def make_layer(group: Group, index: int, **fields: Any) -> Layer:
    return Layer(name=group.name, role=group.role, index=index, module_paths=tuple(group.paths), **fields)


def saved_bytes(nodes: list[fx.Node], saved: dict[str, list[tuple[Any, int, bool]]]) -> tuple[int, int]:
    """Unique activation storage saved for backward by these nodes; and its attention-scores part."""
    seen: dict[Any, tuple[int, bool]] = {}
    for node in nodes:
        for key, size, is_scores in saved.get(node.name, ()):
            seen.setdefault(key, (size, is_scores))
    return sum(s for s, _ in seen.values()), sum(s for s, a in seen.values() if a)


def module_topk(model: nn.Module, paths: list[str]) -> int:
    modules = dict(model.named_modules())
    for path in paths:
        for _, module in modules[path].named_modules():
            for attr in _TOPK_ATTRS:
                value = getattr(module, attr, None)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
    config = getattr(model, "config", None)
    for attr in _TOPK_ATTRS:
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def tied_embedding_params(model: nn.Module) -> int:
    """Elements of an nn.Embedding's weight that an nn.Linear also uses as its weight (a head tied to the
    token embedding, e.g. Hugging Face tie_word_embeddings), 0 when none is (LayerGraph.tied_embedding_params)."""
    embeddings = {id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding)}
    return next((embeddings[id(m.weight)] for m in model.modules()
                 if isinstance(m, nn.Linear) and id(m.weight) in embeddings), 0)
