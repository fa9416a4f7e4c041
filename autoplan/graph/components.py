"""Components of a model, found from its module tree and the captured dataflow: a pure analysis of a
traced graph (capture.py does the tracing and measures each component's layers).

A component is a subtree holding repeated blocks of its own kind: a vision tower's encoder layers, a
language model's decoder layers. Blocks of one class form one family (a ResNet's stages are one family,
so it stays one chain); blocks nested inside another family's block (a MoE's experts) do not count.
Each family's root climbs from its containers to the highest module that holds no other family. With
fewer than two families the model is one chain. The remaining parameterised modules are placed by the
dataflow: one that takes activations from a component and feeds another is a component of its own (a
projector), one only fed by a single component joins it (lm_head), one only feeding a single component
joins that one. Edges carry the bytes that must cross: what leaves the producer, or a smaller tensor the
producer's side can compute alone (a slice of its output); a merge that needs both sides (the image
features scattered into the text embeddings) runs on the consumer's side.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from autoplan.graph import layers, ops
from autoplan.graph.types import Component, ComponentEdge, ComponentGraph, Layer, LayerGraph

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


@dataclass(slots=True)
class Spec:
    """One component being found: its name (first module path) and every module path it covers."""

    name: str
    paths: list[str]
    has_family: bool = True


@dataclass(slots=True)
class Split:
    """The captured graph cut into components: each component's graph nodes (forward order), its layer
    groups and its own sequence length; the edge bytes between components (per traced microbatch)."""

    specs: list[Spec]
    nodes: dict[str, list[fx.Node]]
    groups: dict[str, list[layers.Group]] = field(default_factory=dict)
    seq_lens: dict[str, int] = field(default_factory=dict)
    vocabs: dict[str, int] = field(default_factory=dict)  # token vocabulary of components embedding input ids
    edges: dict[tuple[str, str], int] = field(default_factory=dict)


def find_roots(model: nn.Module) -> list[str]:
    """Roots of the block families, in module order; empty when the model has fewer than two families."""
    families = _families(model)
    if len(families) < 2:
        return []
    roots = [_root(model, paths, [p for f, ps in families.items() if f != fam for p in ps])
             for fam, paths in families.items()]
    if any(a == b or a.startswith(b + ".") or b.startswith(a + ".") for i, a in enumerate(roots)
           for b in roots[i + 1:]):
        return []  # overlapping families: keep the model one chain
    return roots


def _families(model: nn.Module) -> dict[str, list[str]]:
    """Block class -> paths of the containers (>= 2 parameterised children of that class) holding it,
    without containers nested inside another container's child."""
    found: list[tuple[str, str]] = []
    for path, module in model.named_modules():
        if not isinstance(module, _CONTAINERS):
            continue
        kids = [c for c in module.children() if layers.has_params(c)]
        counts = Counter(type(c).__qualname__ for c in kids)
        if counts and counts.most_common(1)[0][1] >= 2:
            found.append((path, counts.most_common(1)[0][0]))
    paths = [p for p, _ in found]
    outer = [(p, f) for p, f in found if not any(p.startswith(q + ".") and p != q for q in paths)]
    families: dict[str, list[str]] = {}
    for path, fam in outer:
        families.setdefault(fam, []).append(path)
    return families


def _root(model: nn.Module, paths: list[str], others: list[str]) -> str:
    """The highest module above `paths` (their common ancestor upwards) holding none of `others`."""
    common = paths[0].split(".")
    for p in paths[1:]:
        parts = p.split(".")
        n = 0
        while n < min(len(parts), len(common)) and parts[n] == common[n]:
            n += 1
        common = common[:n]
    root = ".".join(common)
    while root:
        parent = root.rpartition(".")[0]
        if not parent or any(o == parent or o.startswith(parent + ".") for o in others):
            break
        root = parent
    return root


def leftovers(model: nn.Module, roots: list[str]) -> list[str]:
    """Maximal parameterised subtrees outside every root (not an ancestor of one), in module order."""
    out: list[str] = []
    for path, module in model.named_modules():
        if not path or not layers.has_params(module):
            continue
        if any(path == r or path.startswith(r + ".") or r.startswith(path + ".") for r in roots):
            continue
        if any(path.startswith(o + ".") for o in out):
            continue
        out.append(path)
    return out


def split_graph(graph: fx.Graph, model: nn.Module, roots: list[str], taint: layers.Taint,
                hint: layers.Hint, default_seq_len: int) -> Split:
    """Cut the traced graph into the final components, their layer groups, sequence lengths and edges."""
    specs = [Spec(name=r, paths=[r]) for r in roots]
    specs += [Spec(name=p, paths=[p], has_family=False) for p in leftovers(model, roots)]
    first = _assign(graph, specs)
    specs = _place_leftovers(specs, _edges(graph, first, taint, hint))
    owner = _assign(graph, specs)
    edges = _edges(graph, owner, taint, hint)
    nodes = {s.name: [n for n in graph.nodes if owner.get(n) == s.name] for s in specs}
    split = Split(specs=_topological(specs, edges, graph, owner), nodes=nodes, edges=edges)
    for spec in split.specs:
        units = component_units(model, spec.paths)
        split.groups[spec.name] = layers.group_nodes(nodes[spec.name], units, model)
        split.seq_lens[spec.name] = _sequence_length(split.groups[spec.name], taint, hint, default_seq_len)
        split.vocabs[spec.name] = token_vocab(nodes[spec.name], taint)
    return split


def assemble(split: Split, measured: dict[str, list[Layer]], *, model_name: str, microbatch: int,
             dtype_bytes: int, method: str, notes: tuple[str, ...],
             input_shapes: tuple[tuple[str, tuple[int, ...]], ...]) -> ComponentGraph:
    """The ComponentGraph of a split whose components' layers capture measured."""
    built = []
    for spec in split.specs:
        graph = LayerGraph(model_name=f"{model_name}/{spec.name}", layers=tuple(measured[spec.name]),
                           seq_len=split.seq_lens[spec.name], microbatch=microbatch, dtype_bytes=dtype_bytes,
                           vocab_size=split.vocabs.get(spec.name, 0),
                           num_nodes=len(split.nodes[spec.name]), capture_method=method, notes=notes)
        built.append(Component(name=spec.name, module_paths=tuple(spec.paths), graph=graph,
                               connector=not spec.has_family))
    edges = tuple(ComponentEdge(src=a, dst=b, activation_bytes=n) for (a, b), n in split.edges.items())
    return ComponentGraph(model_name=model_name, components=tuple(built), edges=edges, microbatch=microbatch,
                          input_shapes=input_shapes, notes=notes)


def token_vocab(nodes: list[fx.Node], taint: layers.Taint) -> int:
    """Rows of the embedding tables indexed by a model input (token ids); 0 when none is (a vision
    tower's position table is indexed by a buffer)."""
    rows = [int(n.args[0].meta["val"].shape[0]) for n in nodes
            if ops.op_name(n.target) == "embedding" and len(n.args) > 1 and isinstance(n.args[1], fx.Node)
            and n.args[1].op == "placeholder" and n.args[1] in taint.activation
            and isinstance(n.args[0], fx.Node) and "val" in n.args[0].meta]
    return max(rows, default=0)


def _assign(graph: fx.Graph, specs: list[Spec]) -> dict[fx.Node, str]:
    """call_function node -> the component owning its module path (glue nodes are left out)."""
    by_path = {p: s.name for s in specs for p in s.paths}
    known = set(by_path)
    owner: dict[fx.Node, str] = {}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        unit = layers.unit_of(layers.node_path(node), known)
        if unit is not None:
            owner[node] = by_path[unit]
    return owner


def _topological(specs: list[Spec], edges: dict[tuple[str, str], int], graph: fx.Graph,
                 owner: dict[fx.Node, str]) -> list[Spec]:
    """Components with nodes in a topological order of the edges, ties by first node in the trace (a
    language model's token embedding may run before the vision tower that feeds it)."""
    import networkx as nx

    first = {}
    for i, node in enumerate(graph.nodes):
        first.setdefault(owner.get(node), i)
    dag = nx.DiGraph()
    dag.add_nodes_from(s.name for s in specs if s.name in first)
    dag.add_edges_from(edges)
    if not nx.is_directed_acyclic_graph(dag):
        raise ValueError(f"components {sorted(dag)} feed each other in a cycle: the model cannot be split "
                         f"into components; plan it as one chain with autoplan()")
    by_name = {s.name: s for s in specs}
    return [by_name[n] for n in nx.lexicographical_topological_sort(dag, key=lambda n: first[n])]


def _place_leftovers(specs: list[Spec], edges: dict[tuple[str, str], int]) -> list[Spec]:
    """Connectors (fed by one component, feeding another) stay components; a leftover fed by only one
    component joins it; one only feeding one component joins that; the rest join the first family."""
    out = [s for s in specs if s.has_family]
    for spec in (s for s in specs if not s.has_family):
        producers = sorted({a for a, b in edges if b == spec.name})
        consumers = sorted({b for a, b in edges if a == spec.name})
        if producers and consumers:
            out.append(spec)
            continue
        target = producers[0] if len(producers) == 1 else consumers[0] if len(consumers) == 1 and not producers else None
        if target is None and (producers or consumers):
            out.append(spec)
            continue
        host = next((s for s in out if s.name == target), None) or out[0]
        host.paths.append(spec.name)
    return out


def _edges(graph: fx.Graph, owner: dict[fx.Node, str], taint: layers.Taint, hint: layers.Hint) -> dict[tuple[str, str], int]:
    """(producer, consumer) -> bytes of the distinct activation tensors that must cross."""
    sources = _sources(graph, owner)
    crossing: dict[tuple[str, str], set[fx.Node]] = {}
    memo: dict[tuple[fx.Node, str], frozenset[fx.Node]] = {}
    for node, dst in owner.items():
        for arg in node.all_input_nodes:
            if owner.get(arg) == dst or arg not in taint.activation:
                continue
            for src in sources.get(arg, frozenset()) - {dst}:
                crossing.setdefault((src, dst), set()).update(_sent(arg, src, owner, sources, memo))
    return {key: sum(_nbytes(n, hint) for n in ns) for key, ns in crossing.items()}


def _sources(graph: fx.Graph, owner: dict[fx.Node, str]) -> dict[fx.Node, frozenset[str]]:
    """The components each node's value depends on (glue nodes: the union over their inputs)."""
    out: dict[fx.Node, frozenset[str]] = {}
    for node in graph.nodes:
        if node in owner:
            out[node] = frozenset({owner[node]})
        else:
            out[node] = frozenset().union(*(out.get(a, frozenset()) for a in node.all_input_nodes))
    return out


def _sent(arg: fx.Node, src: str, owner: dict[fx.Node, str], sources: dict[fx.Node, frozenset[str]],
          memo: dict[tuple[fx.Node, str], frozenset[fx.Node]]) -> frozenset[fx.Node]:
    """The tensors `src` sends for `arg`: arg itself when src owns it or alone computes it (a glue slice
    of its output), else what src sends for the inputs of the glue op that mixes it with other sources."""
    key = (arg, src)
    if key not in memo:
        if owner.get(arg) == src or (arg not in owner and sources.get(arg) == frozenset({src})):
            memo[key] = frozenset({arg})
        else:
            memo[key] = frozenset().union(*(_sent(a, src, owner, sources, memo) for a in arg.all_input_nodes
                                            if src in sources.get(a, frozenset())))
    return memo[key]


def _nbytes(node: fx.Node, hint: layers.Hint) -> int:
    return sum(ops.nbytes(t, hint) for t in ops.tensors(node.meta.get("val")))


def component_units(model: nn.Module, paths: list[str]) -> layers.Units:
    """The layer units of one component: layers.find_units on its first module, plus its other paths
    (e.g. lm_head beside the language model) as units of their own."""
    root = paths[0]
    units = layers.find_units(model.get_submodule(root))

    def join(p: str) -> str:
        return f"{root}.{p}" if p else root

    return layers.Units(container=join(units.container), blocks=tuple(join(b) for b in units.blocks),
                        others=tuple(join(o) for o in units.others) + tuple(paths[1:]))


def _sequence_length(groups: list[layers.Group], taint: layers.Taint, hint: layers.Hint, default: int) -> int:
    """Tokens per sample in the component's first block: dim 1 of a [b, s, h] activation entering it
    (H * W of an [b, c, H, W] feature map); `default` when there is none."""
    block = next((g for g in groups if g.role.value == "block"), None)
    if block is None:
        return default
    inside = set(block.nodes)
    for node in block.nodes:
        for arg in node.all_input_nodes:
            val = arg.meta.get("val")
            if arg in inside or arg not in taint.activation or not isinstance(val, torch.Tensor):
                continue
            if val.dim() == 3:
                return hint(val.shape[1])
            if val.dim() == 4:
                return hint(val.shape[2]) * hint(val.shape[3])
    return default


def multimodal_inputs(model: nn.Module, seq_len: int, microbatch: int) -> dict[str, Any] | None:
    """Inputs of a Hugging Face image-text model (LLaVA-style: forward takes pixel_values, the config
    has a vision_config and an image_token_id): pixel_values [microbatch, C, image_size, image_size] and
    input_ids [microbatch, seq_len] whose first tokens stand for the image. None for other models."""
    import inspect

    config = getattr(model, "config", None)
    vision = getattr(config, "vision_config", None)
    if vision is None or getattr(config, "image_token_id", None) is None:
        return None
    if "pixel_values" not in inspect.signature(model.forward).parameters:
        return None
    image_tokens = num_image_tokens(config)
    if seq_len <= image_tokens:
        raise ValueError(f"seq_len {seq_len} leaves no text after the image's {image_tokens} tokens: pass "
                         f"seq_len > {image_tokens} (image tokens + text)")
    side = int(vision.image_size)
    ids = torch.zeros(microbatch, seq_len, dtype=torch.long, device="meta")
    pixels = torch.empty(microbatch, int(getattr(vision, "num_channels", 3)), side, side, device="meta",
                         dtype=next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32))
    return {"input_ids": ids, "pixel_values": pixels, "use_cache": False}


def num_image_tokens(config: Any) -> int:
    """Image tokens a LLaVA-style config puts in the text: (image_size / patch_size)^2 patches, plus the
    class token under vision_feature_select_strategy 'full' (Liu et al. 2023, LLaVA; transformers'
    LlavaModel.get_image_features drops the class token under 'default')."""
    vision = config.vision_config
    patches = (int(vision.image_size) // int(vision.patch_size)) ** 2
    return patches + (1 if getattr(config, "vision_feature_select_strategy", "default") == "full" else 0)


def input_shapes(ep: Any) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(name, shape) of each user input tensor of an ExportedProgram, as traced."""
    from torch.export.graph_signature import InputKind

    user = {s.arg.name for s in ep.graph_signature.input_specs if s.kind is InputKind.USER_INPUT}
    hint = layers.Hint()
    return tuple((n.name, tuple(hint(d) for d in n.meta["val"].shape)) for n in ep.graph.nodes
                 if n.op == "placeholder" and n.name in user and isinstance(n.meta.get("val"), torch.Tensor))


def single(graph: LayerGraph) -> ComponentGraph:
    """A single-chain model's ComponentGraph: one component holding capture()'s graph."""
    shapes = (("input", (graph.microbatch, *graph.input_shape)),) if graph.input_shape else ()
    return ComponentGraph(model_name=graph.model_name, microbatch=graph.microbatch, input_shapes=shapes,
                          components=(Component(name=graph.model_name, module_paths=("",), graph=graph),),
                          notes=graph.notes)
