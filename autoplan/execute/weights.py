"""Give a model's meta parameters real storage that holds this rank's shard only, from a seed or from safetensors.

Called on each pipeline stage after tensor / expert parallelism (parameters are then DTensors whose local
shards are boxes of the full tensor: torch's compute_local_shape_and_global_offset) and before FSDP2, which
shards what it is given, one block at a time. A rank therefore allocates its own tensor / expert shards, and
at most one block's worth more while FSDP2 shards it: a model larger than one host's memory can run.

Seeded init (the same values under every plan, on any rank, for any shard): matrices ~ N(0, std) (the model
config's initializer_range, else 0.02, as GPT-2 / Megatron-LM), norm scales 1, biases and other vectors 0.
The normal values are drawn in fixed chunks of rows, each from its own generator seeded by (seed, parameter
name, chunk), so a shard draws only the rows it holds and equals the same rows of the full tensor.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from autoplan.execute.recompute import original_fqn

CHUNK_ELEMENTS = 1 << 20  # values per generator chunk (whole rows): 4 MB of float32
# stacked expert weight <- per-expert matrices whose rows concatenate (Mixtral w1 = gate, w3 = up; Qwen2-MoE names)
_EXPERT_SOURCES = {"gate_up_proj": (("w1", "w3"), ("gate_proj", "up_proj")), "down_proj": (("w2",), ("down_proj",))}


def _chunk_seed(seed: int, name: str, chunk: int) -> int:
    digest = hashlib.sha256(f"{seed}/{name}/{chunk}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def param_kind(module: nn.Module, name: str, shape: tuple[int, ...]) -> str:
    """"ones" (a norm's scale), "zeros" (biases, other vectors) or "normal" (matrices, stacked experts)."""
    norm = isinstance(module, (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase)) or \
        type(module).__name__.endswith("Norm")
    if norm and name == "weight":
        return "ones"
    return "normal" if len(shape) >= 2 else "zeros"


def init_shard(name: str, shape: tuple[int, ...], offset: tuple[int, ...], local: tuple[int, ...], *, kind: str,
               seed: int, std: float) -> torch.Tensor:
    """The box [offset, offset + local) of the seeded full tensor `name` of `shape`, in float32."""
    if kind == "ones":
        return torch.ones(local)
    if kind == "zeros" or 0 in local:
        return torch.zeros(local)
    full = tuple(shape) or (1,)
    offset, local_box = tuple(offset) or (0,), tuple(local) or (1,)
    row = 1
    for d in full[1:]:
        row *= d
    rows_per_chunk = max(1, CHUNK_ELEMENTS // max(row, 1))
    first, last = offset[0], offset[0] + local_box[0]
    pieces = []
    for chunk in range(first // rows_per_chunk, (last - 1) // rows_per_chunk + 1):
        begin = chunk * rows_per_chunk
        count = min(rows_per_chunk, full[0] - begin)
        generator = torch.Generator().manual_seed(_chunk_seed(seed, name, chunk))
        values = torch.empty((count, *full[1:])).normal_(0.0, std, generator=generator)
        lo, hi = max(first, begin) - begin, min(last, begin + count) - begin
        pieces.append(values[lo:hi])
    block = torch.cat(pieces)
    for dim in range(1, len(full)):
        block = block.narrow(dim, offset[dim], local_box[dim])
    return block.reshape(local).clone()


class WeightFiles:
    """The tensors of a safetensors file, or of a directory of them (a from_pretrained directory: its
    model.safetensors.index.json, else every *.safetensors file), by key; read a box of one without the rest."""

    def __init__(self, path: str | Path, *, base_prefix: str = "") -> None:
        from safetensors import safe_open

        root = Path(path)
        if root.is_file():
            files = [root]
        elif (root / "model.safetensors.index.json").is_file():
            index = json.loads((root / "model.safetensors.index.json").read_text())
            files = sorted({root / f for f in index.get("weight_map", {}).values()})
        else:
            files = sorted(root.glob("*.safetensors")) if root.is_dir() else []
        if not files:
            raise ValueError(f"weights {path}: no .safetensors file there (autoplan reads safetensors only: "
                             f"save with save_pretrained(..., safe_serialization=True) or safetensors.torch)")
        self.path, self.base_prefix = str(path), base_prefix
        self.file_of: dict[str, Path] = {}
        self.shape_of: dict[str, tuple[int, ...]] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    self.file_of[key] = file
                    self.shape_of[key] = tuple(f.get_slice(key).get_shape())
        self._open: dict[Path, Any] = {}

    def key_for(self, name: str) -> str | None:
        """The checkpoint key of parameter `name`: itself, with / without the base model prefix (Hugging Face
        checkpoints of GPT-2 store "h.0..." for "transformer.h.0..."), or Mixtral's ".block_sparse_moe." name."""
        p = self.base_prefix
        candidates = [name]
        if p:
            candidates += [name[len(p) + 1:]] if name.startswith(p + ".") else [f"{p}.{name}"]
        candidates += [c.replace(".mlp.", ".block_sparse_moe.") for c in candidates if ".mlp." in c]
        return next((c for c in candidates if c in self.file_of), None)

    def expert_keys(self, name: str, num_experts: int) -> list[list[str]] | None:
        """For a stacked-experts parameter of transformers 5 (`...experts.gate_up_proj` [E, 2f, h],
        `...experts.down_proj` [E, h, f]) in a checkpoint of per-expert matrices (what save_pretrained writes,
        transformers' conversion_mapping for mixtral / qwen2_moe): per expert, the keys whose rows concatenate."""
        parent, _, leaf = name.rpartition(".")
        if leaf not in _EXPERT_SOURCES or not parent.endswith("experts"):
            return None
        for prefix in dict.fromkeys([parent, parent.replace(".mlp.", ".block_sparse_moe.")]):
            for names in _EXPERT_SOURCES[leaf]:
                keys = [[f"{prefix}.{e}.{n}.weight" for n in names] for e in range(num_experts)]
                if all(k in self.file_of for per in keys for k in per):
                    return keys
        return None

    def _shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...] | None:
        key = self.key_for(name)
        if key is not None:
            return self.shape_of[key]
        keys = self.expert_keys(name, shape[0]) if shape else None
        if keys is None:
            return None
        rows = sum(self.shape_of[k][0] for k in keys[0])
        return (len(keys), rows, *self.shape_of[keys[0][0]][1:])

    def check(self, model: nn.Module) -> None:
        """ValueError, one line, unless every parameter of `model` is in the files with its shape."""
        for name, param in model.named_parameters():
            found = self._shape(name, tuple(param.shape))
            if found is None:
                sample = ", ".join(list(self.file_of)[:3])
                raise ValueError(f"weights {self.path} hold no tensor {name} (shape {list(param.shape)}); they hold "
                                 f"e.g. {sample}: save the weights of this model (state_dict names)")
            if found != tuple(param.shape):
                raise ValueError(f"weights {self.path}: {name} has shape {list(found)} there but the model's is "
                                 f"{list(param.shape)}: the weights are of another model")

    def _slice(self, key: str, box: tuple[slice, ...]) -> torch.Tensor:
        from safetensors import safe_open

        file = self.file_of[key]
        if file not in self._open:
            self._open[file] = safe_open(str(file), framework="pt")
        if not self.shape_of[key]:
            return self._open[file].get_tensor(key)
        return self._open[file].get_slice(key)[box]

    def read(self, name: str, offset: tuple[int, ...], local: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        """The box [offset, offset + local) of parameter `name` (full shape `shape`)."""
        box = tuple(slice(o, o + n) for o, n in zip(offset, local))
        key = self.key_for(name)
        if key is not None:
            return self._slice(key, box)
        keys = self.expert_keys(name, shape[0]) if shape else None
        if keys is None:
            raise KeyError(f"weights {self.path} hold no tensor {name}")
        experts = [torch.cat([self._slice(k, (slice(None),)) for k in keys[e]])[box[1:]]
                   for e in range(box[0].start, box[0].stop)]
        return torch.stack(experts) if experts else torch.empty(local)

    def close(self) -> None:
        self._open.clear()


def _is_meta(param: torch.Tensor) -> bool:
    return (param.to_local() if isinstance(param, DTensor) else param).is_meta


def _box(param: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offset, local shape) of this rank's shard."""
    if isinstance(param, DTensor):
        local, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        return tuple(offset), tuple(local)
    return (0,) * param.dim(), tuple(param.shape)


def _real(param: nn.Parameter, values: torch.Tensor, device: torch.device) -> nn.Parameter:
    dtype = torch.float32 if param.is_floating_point() else param.dtype
    local = values.to(device=device, dtype=dtype).contiguous()
    if isinstance(param, DTensor):
        local = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                   shape=param.shape, stride=param.stride())
    return nn.Parameter(local, requires_grad=param.requires_grad)


def materialise(model: nn.Module, *, device: torch.device, seed: int, std: float,
                weights: WeightFiles | None = None, prefix: str = "") -> None:
    """Replace every meta parameter of `model` (plain or DTensor) by a real one holding this rank's shard, by
    the seeded init or from `weights`; tied parameters stay tied; buffers move to `device`. `prefix`: the
    path of `model` in the whole model (parameter names are the whole model's)."""
    done: dict[int, nn.Parameter] = {}
    for path, module in model.named_modules(prefix=prefix):
        for name, param in list(module._parameters.items()):
            if param is None or not _is_meta(param):
                continue
            if id(param) not in done:
                fqn = original_fqn(f"{path}.{name}" if path else name)
                offset, local = _box(param)
                if weights is not None:
                    values = weights.read(fqn, offset, local, tuple(param.shape))
                else:
                    values = init_shard(fqn, tuple(param.shape), offset, local, seed=seed, std=std,
                                        kind=param_kind(module, name, tuple(param.shape)))
                done[id(param)] = _real(param, values, device)
            module._parameters[name] = done[id(param)]
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.is_meta:
                raise ValueError(f"buffer {path}.{name} is on the meta device: build the model with real buffers")
            if buffer is not None and buffer.device != device:
                module._buffers[name] = buffer.to(device)


def save_weights(model: nn.Module, path: str | Path) -> None:
    """The model's parameters (tied ones once, by their first name) as one safetensors file."""
    from safetensors.torch import save_file

    tensors = {name: p.detach().to("cpu").contiguous() for name, p in model.named_parameters()}
    with contextlib.suppress(FileNotFoundError):
        Path(path).unlink()
    save_file(tensors, str(path))


__all__ = ["CHUNK_ELEMENTS", "WeightFiles", "init_shard", "materialise", "param_kind", "save_weights"]
