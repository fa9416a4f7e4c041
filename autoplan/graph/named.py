"""Models given by name: `load_model(spec)` builds a preset, a "file.py:factory" or a Hugging Face directory on
meta, and a preset's layer graph and fingerprint come from the disk cache (graph/cache.py) or a capture.

Nothing here imports torch, numpy or the search at import: `autoplan plan` calls `prefetch` as soon as it
knows the model and the sequence length, and a cold preset is then captured in a child forked from a process
that holds none of them yet (graph/forked.py: the child imports torch and torch._dynamo, builds, traces,
stores the graph and the fingerprint in the disk cache as an in-process capture does, and sends both back)
while the parent imports the search and loads the cluster on the other core; `preset_graph` collects it.
The planning process then never imports torch, so its search runs as fast as a warm plan's and its exit
skips torch's teardown.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autoplan.graph import cache, forked
from autoplan.graph.types import LayerGraph

_prefetched: dict[tuple[str, int], forked.Pending] = {}  # (preset, seq_len) -> its capture in a child
_fingerprints: dict[str, str] = {}  # preset -> its fingerprint, once known in this process


def load_model(spec: str) -> Any:
    """A preset name, "path/to/file.py:factory" (the file is imported and factory() called on meta) or a Hugging
    Face from_pretrained directory (built from its config.json on meta). Each mistake is one ValueError line."""
    import torch

    from autoplan.models import PRESETS, preset
    from autoplan.models.multimodal import MULTIMODAL_PRESETS
    from autoplan.models.user import call_factory, hf_from_dir, is_file_spec, is_hf_dir
    from autoplan.models.vision import VISION_PRESETS

    if is_file_spec(spec):
        with torch.device("meta"):
            return call_factory(spec)
    if is_hf_dir(spec):
        with torch.device("meta"):
            return hf_from_dir(spec)
    others = {**VISION_PRESETS, **MULTIMODAL_PRESETS}
    if spec in others:
        with torch.device("meta"):
            return others[spec]()
    if spec not in PRESETS:
        raise ValueError(f"unknown model {spec!r}: choose a preset ({', '.join([*PRESETS, *others])}), give "
                         f"file.py:factory or a Hugging Face model directory")
    with torch.device("meta"):
        return preset(spec)


def is_preset_name(spec: str) -> bool:
    """Not a file.py:factory, a path or a directory: a preset's name (checked without importing torch)."""
    return ":" not in spec and "/" not in spec and not Path(spec).exists()


def preset_graph(spec: str, seq_len: int) -> LayerGraph:
    """The preset's graph at seq_len (microbatch 1): what `prefetch` started, else from the disk cache, else
    captured in a forked child where graph.forked.can_fork allows, else in this process."""
    pending = _prefetched.pop((spec, seq_len), None) or _fork(spec, seq_len)
    got = pending.result() if pending is not None else None
    if got is None:  # no child, or it died without a result
        return captured_preset(spec, seq_len)
    graph, _fingerprints[spec] = got
    return graph


def captured_preset(spec: str, seq_len: int) -> LayerGraph:
    """The preset's graph from the disk cache, else built, captured (in this process) and stored with its
    fingerprint."""

    def make() -> LayerGraph:
        from autoplan.graph.capture import capture

        model = load_model(spec)
        preset_fingerprint(spec, model)  # built anyway: its fingerprint is stored too (what a plan carries)
        # built for this capture alone: traced in place
        return capture(model, seq_len=seq_len, microbatch=1, model_name=spec, copy_model=False)

    return cache.cached(cache.preset_key(spec, seq_len=seq_len), make, model_name=spec)


def preset_fingerprint(spec: str, model: Any = None) -> str:
    """The preset's fingerprint: known in this process, else from the disk cache, else computed from `model`
    (built here when None) and stored."""

    def compute() -> str:
        from autoplan.graph.fingerprint import model_fingerprint  # imports torch

        return model_fingerprint(load_model(spec) if model is None else model)

    if spec not in _fingerprints:
        _fingerprints[spec] = cache.cached_text(cache.key_of({"preset fingerprint": spec}), compute)
    return _fingerprints[spec]


def prefetch(spec: Any, seq_len: Any) -> None:
    """Start capturing a preset's graph in a forked child when it is not cached yet; preset_graph collects it.
    Anything else (a module or a file, a bad seq_len, a warm preset, a process holding torch) is left to the
    caller's own path, whose errors then surface as they would without this."""
    if (isinstance(spec, str) and isinstance(seq_len, int) and not isinstance(seq_len, bool) and seq_len > 0
            and is_preset_name(spec) and (spec, seq_len) not in _prefetched):
        pending = _fork(spec, seq_len)
        if pending is not None:
            _prefetched[(spec, seq_len)] = pending


def discard() -> None:
    """Kill the prefetching children whose graph was not asked for (the command failed before its search),
    and reap every capture child (graph.forked.discard)."""
    _prefetched.clear()
    forked.discard()


def _fork(spec: str, seq_len: int) -> forked.Pending | None:
    """A child capturing the preset (storing it in the disk cache) whose result is (graph, fingerprint);
    None when the graph is cached already or forking is not possible here."""
    entry = cache.entry_path(cache.preset_key(spec, seq_len=seq_len))
    if not forked.can_fork() or (entry is not None and entry.exists()):
        return None
    return forked.start(lambda: _child_capture(spec, seq_len))


def _child_capture(spec: str, seq_len: int) -> tuple[LayerGraph, str]:
    """In the child: no OpenBLAS thread pool for numpy, which torch imports (a capture on meta never calls
    BLAS; measured here, its threads took 0.1 s of CPU on the core the parent works on), then the capture."""
    import os

    os.environ["OPENBLAS_NUM_THREADS"] = "1"  # this process only: it was forked, the parent keeps its own
    return captured_preset(spec, seq_len), preset_fingerprint(spec)
