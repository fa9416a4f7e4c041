"""What each module of a model does, for the executor: the layers in forward order (grouped as capture groups
them) and, per block, which projections tensor parallelism splits on their outputs (q, k, v; gate, up) and which
on their inputs (o; down), the attention and MLP modules, the residual-stream norms and the routed experts;
the token embedding, the final norm and the output head.

Found on the graph of one torch.export on the meta device (identical blocks traced once, as capture does), by
dataflow, not by names: q, k and v are the projections feeding the fused attention op (recognise's walk back
through views, RoPE and kv-head repeats), o the projection its output reaches; gate/up take the hidden size to
the FFN width, down takes it back (Megatron-LM's column / row split, Shoeybi et al. 2019). A projection that
fits none of these, or feeds q, k and v at once (a fused qkv), is listed in `unsupported` with the reason.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import torch
from torch import fx, nn
from torch.export.graph_signature import InputKind

from autoplan.graph import layers, ops, recognise
from autoplan.graph.layers import node_path
from autoplan.graph.types import LayerRole

_FORWARD_THROUGH = {"transpose", "reshape", "view", "_unsafe_view", "contiguous", "clone", "permute", "flatten",
                    "_to_copy", "to", "expand"}


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockRoles:
    """One block's modules by role; every path is a full module FQN of the model."""

    column: tuple[str, ...] = ()  # nn.Linear split on output features: q, k, v, gate, up
    row: tuple[str, ...] = ()  # nn.Linear split on input features: o, down
    attention: str = ""  # the module holding q, k, v and o ("" when they have no common submodule)
    attention_op: str = ""  # the module whose forward calls the fused attention op
    mlp: str = ""  # the module holding the dense MLP's projections, or the MoE layer
    experts: str = ""  # the routed experts (stacked 3-D weights or a ModuleList)
    norms: tuple[str, ...] = ()  # norms on the residual stream (outside attention and mlp)
    unsupported: tuple[str, ...] = ()  # "path: why tensor parallelism cannot split it"
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    ffn_hidden_size: int = 0
    num_experts: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerUnits:
    """One layer of the graph: its name (a plan's stage names), role and module paths in first-use order."""

    name: str
    role: LayerRole
    paths: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelRoles:
    layers: tuple[LayerUnits, ...]
    container: str  # the module holding the blocks
    blocks: tuple[tuple[str, BlockRoles], ...]  # (block path, roles) in model order
    embedding: str = ""  # the token nn.Embedding (vocabulary rows)
    head: str = ""  # the output nn.Linear (vocabulary outputs)
    final_norm: str = ""
    tied: bool = False  # head.weight is embedding.weight
    vocab_size: int = 0
    hidden_size: int = 0
    notes: tuple[str, ...] = field(default_factory=tuple)

    def block(self, path: str) -> BlockRoles:
        return dict(self.blocks)[path]

    @property
    def block_paths(self) -> tuple[str, ...]:
        return tuple(path for path, _ in self.blocks)


def model_roles(model: nn.Module, *, seq_len: int = 16) -> ModelRoles:
    """The roles of `model`'s modules, from one export of a meta copy (no weight is read)."""
    capture = importlib.import_module("autoplan.graph.capture")
    shadow = capture._meta_copy(model, torch.float32)
    shadow.train()
    args, kwargs = capture._inputs(shadow, seq_len, 1, None)
    units = layers.find_units(shadow)
    rep_of = capture._representatives(shadow, units)
    reps = sorted(set(rep_of.values()), key=units.blocks.index) if rep_of else list(units.blocks)
    if rep_of:
        capture._keep_only(shadow, units.container, reps)
    program, _ = capture._trace(shadow, args, kwargs)
    if rep_of:
        capture._keep_only(shadow, units.container, list(units.blocks))
    groups = layers.group_nodes(program.graph, units, shadow)
    taint = _taint(program)
    modules = dict(shadow.named_modules())
    token = _token_embedding(program, modules)
    vocab = modules[token].num_embeddings if token else max(
        (m.num_embeddings for m in modules.values() if isinstance(m, nn.Embedding)), default=0)
    by_rep = {g.name: _block_roles(g, shadow, modules, taint) for g in groups if g.role is LayerRole.BLOCK}
    blocks = tuple((b, _moved(by_rep[rep_of.get(b, b)], rep_of.get(b, b), b)) for b in units.blocks
                   if rep_of.get(b, b) in by_rep)
    return _assemble(groups, units, blocks, modules, vocab, rep_of, token)


def _token_embedding(program: torch.export.ExportedProgram, modules: dict[str, nn.Module]) -> str:
    """The nn.Embedding that looks up the model's input ids (not learned positions, which look up aranges)."""
    specs = program.graph_signature.input_specs
    user = {s.arg.name for s in specs if s.kind is InputKind.USER_INPUT}
    for node in program.graph.nodes:
        if ops.op_name(node.target) == "embedding" and len(node.args) > 1:
            ids = node.args[1]
            while isinstance(ids, fx.Node) and ids.op == "call_function" and ops.is_view(ids.target):
                ids = ids.args[0]  # GPT-2 views the ids to [-1, S] first
            if isinstance(ids, fx.Node) and ids.op == "placeholder" and ids.name in user:
                path = node_path(node)
                if isinstance(modules.get(path), nn.Embedding):
                    return path
    return ""


def _taint(program: torch.export.ExportedProgram) -> layers.Taint:
    specs = program.graph_signature.input_specs
    user = {s.arg.name for s in specs if s.kind is InputKind.USER_INPUT}
    params = {s.arg.name for s in specs if s.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)}
    return layers.taint(program.graph, user, params)


def _assemble(groups: list[layers.Group], units: layers.Units, blocks: tuple, modules: dict[str, nn.Module],
              vocab: int, rep_of: dict[str, str], token: str) -> ModelRoles:
    unit_layers: list[LayerUnits] = []
    for group in groups:
        if group.role is LayerRole.BLOCK and rep_of:
            if unit_layers and unit_layers[-1].role is LayerRole.BLOCK:
                continue
            unit_layers += [LayerUnits(name=b, role=LayerRole.BLOCK, paths=(b,)) for b in units.blocks]
            continue
        unit_layers.append(LayerUnits(name=group.name, role=group.role, paths=tuple(group.paths)))
    edge = {LayerRole.EMBEDDING: [], LayerRole.HEAD: []}
    for unit in unit_layers:
        if unit.role in edge:
            edge[unit.role] += list(unit.paths)
    embedding = token or _find(edge[LayerRole.EMBEDDING], modules, lambda m: isinstance(m, nn.Embedding)
                               and m.num_embeddings == vocab)
    head = _find(edge[LayerRole.HEAD], modules, lambda m: isinstance(m, nn.Linear) and m.out_features == vocab)
    final_norm = _find(edge[LayerRole.HEAD], modules, _is_norm)
    tied = bool(embedding and head and modules[head].weight is modules[embedding].weight)
    hidden = modules[embedding].embedding_dim if embedding else (modules[head].in_features if head else 0)
    return ModelRoles(layers=tuple(unit_layers), container=units.container, blocks=blocks, embedding=embedding,
                      head=head, final_norm=final_norm, tied=tied, vocab_size=vocab, hidden_size=hidden)


def _find(paths: list[str], modules: dict[str, nn.Module], want) -> str:
    for path in paths:
        for sub, module in modules[path].named_modules(prefix=path):
            if want(module):
                return sub
    return ""


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith("Norm")


def _moved(roles: BlockRoles, rep: str, block: str) -> BlockRoles:
    """The roles of `rep` re-rooted at the identical block `block`."""
    if rep == block:
        return roles

    def move(path: str) -> str:
        return block + path[len(rep):] if path == rep or path.startswith(rep + ".") else path

    out = {}
    for name in BlockRoles.__slots__:
        value = getattr(roles, name)
        if isinstance(value, str):
            value = move(value)
        elif isinstance(value, tuple):
            value = tuple(move(v) for v in value)
        out[name] = value
    return BlockRoles(**out)


def _linear_path(node: fx.Node | None) -> str:
    return node_path(node) if node is not None else ""


def _block_roles(group: layers.Group, model: nn.Module, modules: dict[str, nn.Module],
                 taint: layers.Taint) -> BlockRoles:
    nodes, inside, block = group.nodes, set(group.nodes), group.name
    hint = layers.Hint()
    hidden = recognise.layer_hidden(nodes, taint, hint)
    experts = recognise.find_experts(model, [block], hidden)
    expert_path = experts.paths[0] if experts else ""
    unsupported: list[str] = []
    attn, shape = _attention_projections(nodes, inside, modules, unsupported)
    attention_op = next((node_path(n) for n in nodes if ops.is_attention(n.target)), "")
    mlp_path = expert_path.rpartition(".")[0] if experts else ""
    column, row = list(attn[:3]), list(attn[3:])
    dense_col, dense_row = [], []
    for path, module in modules[block].named_modules(prefix=block):
        if not isinstance(module, nn.Linear) or path in attn or _under(path, mlp_path or expert_path):
            continue
        if experts and module.out_features == experts.num_experts:
            continue  # a router (replicated)
        if module.in_features == hidden and module.out_features != hidden:
            dense_col.append(path)
        elif module.out_features == hidden and module.in_features != hidden:
            dense_row.append(path)
        else:
            unsupported.append(f"{path}: an nn.Linear {module.in_features} -> {module.out_features} that is neither "
                               f"a projection into the attention op nor an MLP up / down projection")
    if not experts and (dense_col or dense_row):
        mlp_path = _common_parent(dense_col + dense_row, block)
    attention = _common_parent(list(attn), block) if all(attn) and attn else ""
    norms = [p for p, m in modules[block].named_modules(prefix=block)
             if _is_norm(m) and not _under(p, attention) and not _under(p, mlp_path)]
    return BlockRoles(
        column=tuple(p for p in column if p) + tuple(dense_col), row=tuple(p for p in row if p) + tuple(dense_row),
        attention=attention, attention_op=attention_op, mlp=mlp_path, experts=expert_path, norms=tuple(norms), unsupported=tuple(unsupported),
        num_heads=shape[0], num_kv_heads=shape[1], head_dim=shape[2],
        ffn_hidden_size=experts.ffn_hidden_size if experts else max(
            (modules[p].out_features for p in dense_col), default=0),
        num_experts=experts.num_experts if experts else 0)


def _under(path: str, root: str) -> bool:
    return bool(root) and (path == root or path.startswith(root + "."))


def _common_parent(paths: list[str], block: str) -> str:
    """The deepest module holding every path, if it lies strictly inside `block`; else ""."""
    parts = [p.split(".") for p in paths if p]
    if not parts:
        return ""
    common = []
    for names in zip(*parts):
        if len(set(names)) != 1:
            break
        common.append(names[0])
    parent = ".".join(common)
    if len(parts) == 1 or parent == paths[0]:
        parent = parent.rpartition(".")[0]
    return parent if parent.startswith(block + ".") else ""


def _attention_projections(nodes: list[fx.Node], inside: set[fx.Node], modules: dict[str, nn.Module],
                           unsupported: list[str]) -> tuple[tuple[str, ...], tuple[int, int, int]]:
    """(q, k, v, o) module paths of the block's fused attention op and (heads, kv heads, head dim);
    ("", ) * 4 when there is none. Projections that are not plain nn.Linear go to `unsupported`."""
    core = next((n for n in nodes if ops.is_attention(n.target)), None)
    if core is None:
        return (), (0, 0, 0)
    sources = [recognise._source_linear(core.args[i], inside) for i in range(3)]
    out = _forward_linear(core, inside)
    paths = tuple(_linear_path(n) for n in (*sources, out))
    q_val = core.args[0].meta["val"]
    heads, head_dim = int(q_val.shape[-3]), int(q_val.shape[-1])
    if sources[0] is None or len({id(s) for s in sources}) < 3:
        fused = next((node_path(n) for n in nodes if ops.op_name(n.target) in ("linear", "addmm", "mm")), "?")
        unsupported.append(f"{fused}: one projection computes q, k and v together (a fused qkv): tensor "
                           f"parallelism here splits separate q, k and v projections by heads")
        return (), (heads, 0, head_dim)
    for path in paths:
        if path and not isinstance(modules.get(path), nn.Linear):
            kind = type(modules[path]).__name__ if path in modules else "a functional op"
            unsupported.append(f"{path}: a {kind}, not an nn.Linear (DTensor's ColwiseParallel / RowwiseParallel "
                               f"split nn.Linear)")
            return (), (heads, 0, head_dim)
    kv_width = modules[paths[1]].out_features
    return paths, (heads, kv_width // head_dim if head_dim else 0, head_dim)


def _forward_linear(start: fx.Node, inside: set[fx.Node]) -> fx.Node | None:
    """The first linear the output of `start` reaches through views (the attention output projection)."""
    node = start
    for _ in range(64):
        users = [u for u in node.users if u in inside]
        if not users:
            return None
        nxt = users[0]
        name = ops.op_name(nxt.target)
        if name == "linear":
            return nxt
        if name == "getitem" or ops.is_view(nxt.target) or name in _FORWARD_THROUGH:
            node = nxt
            continue
        return None
    return None


__all__ = ["BlockRoles", "LayerUnits", "ModelRoles", "model_roles"]
