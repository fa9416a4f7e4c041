"""A disk memo of the layer table's per-layer costs, so that a second plan on the same cluster estimates no
layer twice: estimate_layer is a pure function of the layer, the cluster, seq_len and the layer table's key
(tp, cp, ep, sp, microbatch, recompute, etp, eep), so its fields are stored per (layer, cluster, seq_len,
engine, cost code) and looked up by key. The code version hashes autoplan/cost, autoplan/plan and this package's surrogate (which picks the
fields); any edit there, or any other layer or cluster, is another entry. Entries are .npz arrays (never
unpickled), merged with what is on disk and renamed into place (autoplan.graph.cache.replace_atomically),
next to the graph cache (cache_root()/layer-costs; AUTOPLAN_CACHE_DIR=off disables both).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
from collections.abc import Callable, Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from autoplan.search.pricing import int_codes


@lru_cache(maxsize=1)
def _code_version() -> str:
    import autoplan

    root = Path(autoplan.__file__).parent
    digest = hashlib.sha256(autoplan.__version__.encode())
    for path in sorted([*(root / "cost").glob("*.py"), *(root / "plan").glob("*.py"), root / "search" / "surrogate.py"]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _entry(layer: Any, cluster: Any, seq_len: int, fields: tuple[str, ...], engine: Any) -> Path | None:
    from autoplan.graph.cache import cache_root

    root = cache_root()
    if root is None:
        return None
    engine_fields = dataclasses.asdict(engine) if engine is not None else "default"
    described = json.dumps([dataclasses.asdict(layer), dataclasses.asdict(cluster), seq_len, fields, engine_fields,
                            _code_version()], sort_keys=True, default=str)
    return root / "layer-costs" / f"{hashlib.sha256(described.encode()).hexdigest()}.npz"


def _read(path: Path, width: int, fields: int) -> tuple[np.ndarray, np.ndarray]:
    """The stored (keys [n, width], values [n, fields]); empty when absent, unreadable or of another shape."""
    try:
        with np.load(path) as data:
            keys, values = data["keys"], data["values"]
        if keys.ndim == 2 and keys.shape[1] == width and values.shape == (len(keys), fields):
            return keys, values
    except (OSError, ValueError, KeyError):
        pass
    return np.zeros((0, width), dtype=np.int64), np.zeros((0, fields))


def _match(stored: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """For each row of `keys`, the index of the equal row of `stored`, or -1."""
    both = np.concatenate([stored, keys])
    _, inverse = np.unique(int_codes(*both.T), return_inverse=True)  # rows as integers: a 1-D unique
    inverse = inverse.reshape(-1)
    where = np.full(inverse.max(initial=-1) + 1, -1)
    where[inverse[:len(stored)]] = np.arange(len(stored))
    return where[inverse[len(stored):]]


def layer_costs(layer: Any, cluster: Any, seq_len: int, fields: tuple[str, ...], keys: np.ndarray,
                compute: Callable[[np.ndarray], np.ndarray], *, engine: Any = None) -> np.ndarray:
    """The cost fields [n, len(fields)] of `layer` at each key row of `keys` [n, k] for `engine` (None: the
    cost model's default): from the memo where stored, else compute(indices of the missing rows), which are
    then added to the memo."""
    keys = np.asarray(keys, dtype=np.int64)
    path = _entry(layer, cluster, seq_len, fields, engine)
    if path is None:
        return compute(np.arange(len(keys)))
    stored_keys, stored = _read(path, keys.shape[1], len(fields))
    found = _match(stored_keys, keys)
    out = np.empty((len(keys), len(fields)))
    out[found >= 0] = stored[found[found >= 0]]
    missing = np.nonzero(found < 0)[0]
    if len(missing):
        out[missing] = compute(missing)
        _add(path, keys[missing], out[missing])
    return out


def _add(path: Path, keys: np.ndarray, values: np.ndarray) -> None:
    """Merge new rows with what is on disk now (another plan, or another piece of this search, may have added
    some) and rename into place, holding a lock on the entry meanwhile so that two writers of one entry cannot
    drop each other's rows (the search's pieces write the same layers' entries at the same time)."""
    from autoplan.graph.cache import replace_atomically

    with _locked(path):
        old_keys, old = _read(path, keys.shape[1], values.shape[1])
        keep = _match(keys, old_keys) < 0
        keys, values = np.concatenate([old_keys[keep], keys]), np.concatenate([old[keep], values])
        replace_atomically(path, lambda f: np.savez(f, keys=keys, values=values), binary=True)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive advisory lock (fcntl.flock on `path`.lock) around the block; none where flock is missing
    or the lock file cannot be made (then a concurrent writer may drop rows: they are recomputed later)."""
    try:
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path.with_suffix(".lock"), "w")  # noqa: SIM115 - held open for the lock's lifetime
    except (ImportError, OSError):
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
