"""A disk memo of the layer table's per-layer costs, so that a second plan on the same cluster estimates no
layer twice: estimate_layer is a pure function of the layer, the cluster, seq_len and the key (tp, cp, ep,
sp, microbatch, recompute), so its fields are stored per (layer, cluster, seq_len, cost code) and looked up
by key. The code version hashes autoplan/cost, autoplan/plan and this package's surrogate (which picks the
fields); any edit there, or any other layer or cluster, is another entry. Entries are .npz arrays (never
unpickled), merged with what is on disk and renamed into place (autoplan.graph.cache.replace_atomically),
next to the graph cache (cache_root()/layer-costs; AUTOPLAN_CACHE_DIR=off disables both).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

# mixed-radix packing of a key row (tp, cp, ep, sp, microbatch, recompute) into one int64: 10 + 16 + 12 + 1 +
# 22 + 2 = 63 bits; rows outside these ranges are simply not cached
_RADIX_BITS = (10, 16, 12, 1, 22, 2)


def _pack(keys: np.ndarray) -> np.ndarray | None:
    if len(keys) and ((keys < 0) | (keys >= 2 ** np.array(_RADIX_BITS))).any():
        return None
    code = np.zeros(len(keys), dtype=np.int64)
    for i, bits in enumerate(_RADIX_BITS):
        code = (code << bits) | keys[:, i].astype(np.int64)
    return code


@lru_cache(maxsize=1)
def _code_version() -> str:
    import autoplan

    root = Path(autoplan.__file__).parent
    digest = hashlib.sha256(autoplan.__version__.encode())
    for path in sorted([*(root / "cost").glob("*.py"), *(root / "plan").glob("*.py"), root / "search" / "surrogate.py"]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _entry(layer: Any, cluster: Any, seq_len: int, fields: tuple[str, ...]) -> Path | None:
    from autoplan.graph.cache import cache_root

    root = cache_root()
    if root is None:
        return None
    described = json.dumps([dataclasses.asdict(layer), dataclasses.asdict(cluster), seq_len, fields, _code_version()],
                           sort_keys=True, default=str)
    return root / "layer-costs" / f"{hashlib.sha256(described.encode()).hexdigest()}.npz"


def _read(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with np.load(path) as data:
            return data["codes"], data["values"]
    except (OSError, ValueError, KeyError):
        return np.zeros(0, dtype=np.int64), np.zeros((0, 0))


def layer_costs(layer: Any, cluster: Any, seq_len: int, fields: tuple[str, ...], keys: np.ndarray,
                compute: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """The cost fields [n, len(fields)] of `layer` at each key row [n, 6]: from the memo where stored, else
    compute(missing rows), which are then added to the memo."""
    path, codes = _entry(layer, cluster, seq_len, fields), _pack(keys)
    if path is None or codes is None:
        return compute(keys)
    stored_codes, stored = _read(path)
    out = np.empty((len(keys), len(fields)))
    hit = np.isin(codes, stored_codes) if stored.shape[1:] == (len(fields),) else np.zeros(len(keys), bool)
    if hit.any():
        order = np.argsort(stored_codes)
        out[hit] = stored[order[np.searchsorted(stored_codes, codes[hit], sorter=order)]]
    if not hit.all():
        out[~hit] = compute(keys[~hit])
        _add(path, codes[~hit], out[~hit])
    return out


def _add(path: Path, codes: np.ndarray, values: np.ndarray) -> None:
    """Merge new rows with what is on disk now (another plan may have added some) and rename into place."""
    from autoplan.graph.cache import replace_atomically

    old_codes, old = _read(path)
    if old.shape[1:] == values.shape[1:]:
        keep = ~np.isin(old_codes, codes)
        codes, values = np.concatenate([old_codes[keep], codes]), np.concatenate([old[keep], values])
    replace_atomically(path, lambda f: np.savez(f, codes=codes, values=values), binary=True)
