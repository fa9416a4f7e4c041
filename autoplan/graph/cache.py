"""An on-disk cache of captured LayerGraphs, keyed by a fingerprint of the model's structure, so that a second
plan of the same model skips capture.

The key hashes what decides the graph: the module tree (each module's path, class, the code of its forward,
its plain attributes such as head counts and eps; every parameter's and buffer's shape and dtype), the
capture settings (seq_len, microbatch, dtype, example input shapes), and the code version (autoplan's graph
and model sources, autoplan's and torch's versions). A preset name is keyed by the name and the code version
alone (the preset's module tree is a function of autoplan/models), which needs no torch: a warm plan of a
preset never imports it. Entries are JSON (never unpickled), written to a temporary file and renamed into
place, so concurrent writers cannot leave a torn file; an unreadable entry is a miss.

Directory: $AUTOPLAN_CACHE_DIR, else $XDG_CACHE_HOME/autoplan, else ~/.cache/autoplan (graphs/ inside);
AUTOPLAN_CACHE_DIR=off disables it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import importlib.metadata
import json
import marshal
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from autoplan.graph.types import Layer, LayerGraph, LayerRole

FORMAT_VERSION = 1
_SOURCES = ("graph", "models")  # autoplan packages whose code decides a captured graph


def cache_root() -> Path | None:
    """autoplan's cache directory, or None when caching is off (AUTOPLAN_CACHE_DIR=off)."""
    override = os.environ.get("AUTOPLAN_CACHE_DIR")
    if override and override.lower() in ("off", "0", "none", "false"):
        return None
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "autoplan"


def cache_dir() -> Path | None:
    """Where graphs are cached (graphs/ under cache_root), or None when caching is off."""
    root = cache_root()
    return None if root is None else root / "graphs"


def replace_atomically(path: Path, write: Callable[[Any], None], *, binary: bool = False) -> None:
    """write(file) into a temporary file next to `path`, then rename it over `path` (readers see the old
    file or the new one, never a torn one); errors writing a cache never fail a plan."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
        with os.fdopen(fd, "wb" if binary else "w") as f:
            write(f)
        os.replace(tmp, path)
        tmp = None
    except OSError:
        pass
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


@lru_cache(maxsize=1)
def code_version() -> str:
    """A hash of autoplan's graph and model sources and of the autoplan and torch versions."""
    import autoplan

    root = Path(autoplan.__file__).parent
    digest = hashlib.sha256(f"{autoplan.__version__}|torch {_torch_version()}".encode())
    for package in _SOURCES:
        for path in sorted((root / package).glob("*.py")):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _torch_version() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - torch is a dependency
        return "unknown"


def key_of(parts: Mapping[str, Any]) -> str:
    """The cache key of a JSON-able description of the structure (with the code version folded in)."""
    text = json.dumps({**parts, "code": code_version(), "format": FORMAT_VERSION}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def preset_key(name: str, *, seq_len: int, microbatch: int = 1) -> str:
    return key_of({"preset": name, "seq_len": seq_len, "microbatch": microbatch})


def _plain(value: Any, depth: int = 0) -> Any:
    """A module attribute as JSON-able data when it is plain (numbers, strings, tuples of them, dataclass
    or to_dict() configs); None for anything else (tensors, modules and callables are covered elsewhere)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if depth > 3:
        return None
    if isinstance(value, (tuple, list)):
        return [_plain(v, depth + 1) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v, depth + 1) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value), depth + 1)
    if callable(getattr(value, "to_dict", None)):
        return _plain(value.to_dict(), depth + 1)
    return None


def _code_hash(cls: type) -> str:
    """A hash of the code of every function the class defines (forward and its helpers)."""
    digest = hashlib.sha256()
    for name, value in sorted(vars(cls).items()):
        code = getattr(value, "__code__", None)
        if code is not None:
            digest.update(name.encode() + b"\0" + marshal.dumps(code))
    return digest.hexdigest()[:16]


def module_fingerprint(model: Any) -> dict[str, Any]:
    """The structure of an nn.Module: per module its path, class, forward code and plain attributes; per
    parameter and buffer its path, shape, dtype and requires_grad (duck-typed: no torch import here)."""
    modules = []
    for path, module in model.named_modules():
        cls = type(module)
        attrs = {k: _plain(v) for k, v in sorted(vars(module).items())
                 if not k.startswith("_") and k != "training" and _plain(v) is not None}
        modules.append([path, f"{cls.__module__}.{cls.__qualname__}", _code_hash(cls), attrs])
    tensors = [[p, list(t.shape), str(t.dtype), bool(getattr(t, "requires_grad", False))]
               for p, t in [*model.named_parameters(), *model.named_buffers()]]
    return {"modules": modules, "tensors": tensors}


def entry_path(key: str, directory: Path | None = None) -> Path | None:
    """Where the graph of `key` is (or would be) stored; None with caching off."""
    directory = cache_dir() if directory is None else directory
    return None if directory is None else directory / f"{key}.json"


def load(key: str, directory: Path | None = None) -> LayerGraph | None:
    """The cached graph of `key`, or None (no entry, caching off, or an unreadable entry)."""
    path = entry_path(key, directory)
    if path is None:
        return None
    try:
        data = json.loads(path.read_text())
        return graph_from_dict(data)
    except (OSError, ValueError, TypeError, KeyError):
        return None


def store(key: str, graph: LayerGraph, directory: Path | None = None) -> None:
    """Write the entry atomically (a temporary file in the same directory, then os.replace); errors writing
    the cache never fail a plan."""
    path = entry_path(key, directory)
    if path is not None:
        replace_atomically(path, lambda f: json.dump(graph_to_dict(graph), f))


def cached(key: str, make: Callable[[], LayerGraph], *, model_name: str | None = None) -> LayerGraph:
    """The cached graph of `key` (renamed to `model_name` when given), else make() stored under it."""
    graph = load(key)
    if graph is None:
        with gc_paused():
            graph = make()
        store(key, graph)
    if model_name and graph.model_name != model_name:
        graph = dataclasses.replace(graph, model_name=model_name)
    return graph


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off for the block, as it was after. A capture imports torch and
    torch._dynamo and traces: hundreds of thousands of long-lived objects, and every 700 net allocations
    (gc.get_threshold()) start a collection, the oldest generation's scanning all of them again (Python docs,
    "gc" and the Developer's Guide "Garbage collector design": generations and thresholds); paused, a cold
    capture of a preset takes 0.4 s less here. Reference counting still frees everything acyclic meanwhile,
    and cycles made in the block go at the next collection."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def cached_text(key: str, make: Callable[[], str]) -> str:
    """A short string (a model's fingerprint) cached under `key` like a graph, else make() stored."""
    directory = cache_dir()
    path = None if directory is None else directory / f"{key}.txt"
    if path is not None:
        try:
            return path.read_text()
        except OSError:
            pass
    text = make()
    if path is not None:
        replace_atomically(path, lambda f: f.write(text))
    return text


def graph_to_dict(graph: LayerGraph) -> dict[str, Any]:
    out = {f.name: getattr(graph, f.name) for f in dataclasses.fields(graph) if f.name != "layers"}
    out["layers"] = [{f.name: getattr(layer, f.name) for f in dataclasses.fields(layer)} for layer in graph.layers]
    for layer in out["layers"]:
        layer["role"] = layer["role"].value
    return {"format": FORMAT_VERSION, "graph": out}


def _tuples(value: Any) -> Any:
    """JSON lists back to the tuples the frozen types hold (nested too)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def graph_from_dict(data: Mapping[str, Any]) -> LayerGraph:
    if data.get("format") != FORMAT_VERSION:
        raise ValueError(f"cache format {data.get('format')!r}, expected {FORMAT_VERSION}")
    g = {k: _tuples(v) for k, v in data["graph"].items() if k != "layers"}
    layers = tuple(Layer(**{**{k: _tuples(v) for k, v in d.items()}, "role": LayerRole(d["role"])})
                   for d in data["graph"]["layers"])
    return LayerGraph(**{**g, "layers": layers})
