"""Where every rank gets its model from: a ModelSpec, resolved once in the parent, built on each rank.

- a preset name: the reference Transformer, built whole on the CPU from the seed (apply.py's path);
- "path/to/file.py:factory" or a Hugging Face `from_pretrained` directory: rebuilt on each rank from it;
- an nn.Module from Python: its skeleton (parameters on the meta device, buffers kept) travels in the spec;
  its weights, when it has real ones, are written once as safetensors (execute.weights) for the ranks to read;
- a vision preset name (autoplan.models.vision: vit-tiny, resnet-tiny, ...): rebuilt on each rank by name, like
  a file.py:factory source. A model without tokens (its input a float tensor, e.g. images) records the shape of
  one sample and its number of outputs (classes): the ranks train it on seeded images and class labels.
Non-preset models are built with their parameters on the meta device and their buffers real (`params_on_meta`),
so a rank allocates only its own shards (execute.weights.materialise). They carry `roles` (graph.roles, found
once in the parent) and a `family` naming the stage runner (execute.runner).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from autoplan.graph.roles import ModelRoles
from autoplan.models.transformer import INIT_STD
from autoplan.models.user import call_factory, hf_from_dir, is_file_spec, is_hf_dir, model_name_of

FAMILIES = ("preset", "hf-decoder", "gpt2", "module")


@dataclass(frozen=True, eq=False, kw_only=True)
class ModelSpec:
    """What each rank builds. `source`: a preset name, "file.py:factory" (absolute path) or a Hugging Face
    directory; "" when `skeleton` (a module with meta parameters) is given. `weights`: a safetensors file or a
    directory of them; None: the seeded init of execute.weights. `init_std`: that init's standard deviation."""

    name: str
    family: str = "preset"
    source: str = ""
    skeleton: nn.Module | None = None
    roles: ModelRoles | None = None
    weights: str | None = None
    init_std: float = INIT_STD
    base_prefix: str = ""  # Hugging Face base_model_prefix ("model", "transformer"): checkpoint key aliases
    input_shape: tuple[int, ...] = ()  # one sample of a model without tokens (channels, height, width); ()
    num_outputs: int = 0  # its outputs per sample (classes), the targets' range

    @property
    def is_preset(self) -> bool:
        return self.family == "preset"

    def build(self) -> nn.Module:
        """A fresh copy of the model: parameters on the meta device, buffers real."""
        if self.skeleton is not None:
            return copy.deepcopy(self.skeleton)
        return load_meta(self.source)


_INIT_OPS = frozenset({"normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
                       "xavier_normal_", "trunc_normal_", "zero_", "zeros_", "ones_", "fill_", "constant_",
                       "orthogonal_"})


class SkipMetaInit(TorchFunctionMode):
    """Skip the in-place init ops (nn.init.*, Tensor.normal_, ...) on meta tensors: they store nothing, and on
    meta they run through torch._refs, whose first use imports torch._dynamo (about 2 s here)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in _INIT_OPS:
            target = args[0] if args else next(iter(kwargs.values()), None)
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


@contextlib.contextmanager
def meta_device() -> Iterator[None]:
    """Build on the meta device, skipping the init ops (SkipMetaInit)."""
    with torch.device("meta"), SkipMetaInit():
        yield


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (no memory, no init) while buffers
    (RoPE frequencies, masks) are computed for real, as accelerate's init_empty_weights(include_buffers=False)."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            kind = type(module._parameters[name])
            module._parameters[name] = kind(module._parameters[name].to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        with SkipMetaInit():
            yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def load_meta(source: str) -> nn.Module:
    """The model of a "file.py:factory" or Hugging Face directory source, parameters on meta."""
    from autoplan.models.vision import VISION_PRESETS

    with params_on_meta():
        if source in VISION_PRESETS:
            return VISION_PRESETS[source]()
        if is_file_spec(source):
            return call_factory(source)
        if is_hf_dir(source):
            return hf_from_dir(source)
    raise ValueError(f"model source {source!r} is neither path/to/file.py:factory nor a Hugging Face directory")


def skeleton_of(model: nn.Module) -> nn.Module:
    """A copy of `model` with every parameter on the meta device (no weight copied) and its buffers kept;
    meta buffers of a module built from a config (Hugging Face RoPE) are recomputed from that config."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
    skeleton = copy.deepcopy(model, memo)
    for path, module in skeleton.named_modules():
        missing = [n for n, b in module.named_buffers(recurse=False) if b.is_meta]
        if missing:
            _rebuild_buffers(module, path, missing)
    return skeleton


def _rebuild_buffers(module: nn.Module, path: str, names: list[str]) -> None:
    config = getattr(module, "config", None)
    fresh = None
    if config is not None:
        with contextlib.suppress(Exception):
            fresh = type(module)(config)
    for name in names:
        buffer = getattr(fresh, name, None) if fresh is not None else None
        if not isinstance(buffer, torch.Tensor) or buffer.is_meta or buffer.shape != getattr(module, name).shape:
            where = f"{path}.{name}" if path else name
            raise ValueError(f"buffer {where} is on the meta device and cannot be recomputed: build the model with "
                             f"real buffers (parameters alone on meta) or pass path/to/file.py:factory")
        module._buffers[name] = buffer


def family_of(model: nn.Module, roles: ModelRoles) -> str:
    """The stage runner for `model`: a Hugging Face decoder (embed_tokens / layers / norm / lm_head, RoPE),
    GPT-2 (wte / wpe / h / ln_f / lm_head), or "module" (any other block model)."""
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    if base is None or not hasattr(model, "lm_head"):
        return "module"
    if all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm")) and roles.container == f"{prefix}.layers":
        return "hf-decoder"
    if all(hasattr(base, a) for a in ("wte", "wpe", "h", "ln_f")) and roles.container == f"{prefix}.h":
        return "gpt2"
    return "module"


def check_importable(model: nn.Module) -> None:
    """The ranks unpickle the skeleton: every module class must be importable by its module name."""
    for cls in {type(m) for m in model.modules()}:
        if cls.__module__ == "__main__" or importlib.util.find_spec(cls.__module__.split(".")[0]) is None:
            raise ValueError(f"model class {cls.__qualname__} is defined in {cls.__module__}, which the ranks cannot "
                             f"import: move it into a module file, or pass path/to/file.py:factory")


def model_spec(model: str | nn.Module, *, weights: str | None = None, seq_len: int = 16) -> tuple[ModelSpec, nn.Module]:
    """(the spec the ranks build from, the model on the meta device for the checks before launch). `seq_len`:
    what a model without tokens is traced at (its positions fix the patches); token models take at most 16."""
    from autoplan.models import PRESETS, preset
    from autoplan.models.vision import VISION_PRESETS

    if isinstance(model, str) and model in PRESETS:
        if weights:
            raise ValueError(f"weights are read for your own models, not for the preset {model!r}")
        with meta_device():
            return ModelSpec(name=model, source=model), preset(model)
    if isinstance(model, str) and model in VISION_PRESETS:
        meta = load_meta(model)
        spec = ModelSpec(name=model, source=model)
    elif isinstance(model, str):
        source = _absolute(model)
        meta = load_meta(source)
        if weights is None and is_hf_dir(source):
            weights = source
        spec = ModelSpec(name=model_name_of(model), source=source)
    elif isinstance(model, nn.Module):
        check_importable(model)
        meta = skeleton_of(model)
        spec = ModelSpec(name=_name_of(model), skeleton=meta)
    else:
        raise ValueError(f"model must be a preset name, path/to/file.py:factory, a Hugging Face model directory or "
                         f"an nn.Module, got {type(model).__name__}")
    from autoplan.graph.roles import model_roles

    tokens = any(isinstance(m, nn.Embedding) for m in meta.modules())
    roles = model_roles(meta, seq_len=min(seq_len, 16) if tokens else seq_len)
    config = getattr(meta, "config", None)
    std = getattr(config, "initializer_range", None)
    spec = replace(spec, family=family_of(meta, roles), roles=roles, weights=str(weights) if weights else None,
                   init_std=float(std) if isinstance(std, (int, float)) else INIT_STD,
                   base_prefix=getattr(meta, "base_model_prefix", "") or "")
    return (spec if tokens else replace(spec, **_sample_io(meta, seq_len))), meta


def _sample_io(meta: nn.Module, seq_len: int) -> dict[str, Any]:
    """input_shape and num_outputs of a model without tokens: the input capture traces it with (graph.capture:
    seq_len patches of its first convolution) and the last dimension of its output, on a meta copy."""
    from autoplan.execute.runner import logits_of
    from autoplan.graph.capture import _inputs

    args, kwargs = _inputs(meta, seq_len, 1, None)
    image = args[0] if args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point() else None
    if image is None or kwargs:
        return {}
    with torch.device("meta"):
        out = logits_of(copy.deepcopy(meta).to("meta")(image))
    return {"input_shape": tuple(image.shape[1:]), "num_outputs": int(out.shape[-1])}


def _absolute(source: str) -> str:
    if is_file_spec(source):
        path, factory = source.rsplit(":", 1)
        return f"{Path(path).resolve()}:{factory}"
    if Path(source).is_dir():
        return str(Path(source).resolve())
    raise ValueError(f"unknown model {source!r}: give a preset name (see `autoplan models`), path/to/file.py:factory "
                     f"or a Hugging Face model directory")


def _name_of(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    for attr in ("name_or_path", "_name_or_path", "model_type"):
        value = getattr(config, attr, None)
        if isinstance(value, str) and value:
            return value
    return type(model).__name__


def has_real_weights(model: nn.Module) -> bool:
    return any(not p.is_meta for p in model.parameters())


__all__ = ["FAMILIES", "ModelSpec", "check_importable", "family_of", "has_real_weights", "load_meta", "model_spec",
           "params_on_meta", "skeleton_of"]
