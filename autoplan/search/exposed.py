"""The quick estimate's closed forms of overlapped communication over [candidates, pipeline ranks] arrays
(search/assemble.py): L equal layers of compute c, a prefetched collective g before and a collective q after
each, as overlap.exposed_s simulates them, g + (L - 1) max(0, g + q - c) + q, and cost.dataparallel._overlap's
exposed, serial and hidden parts. A collective that is not there is None rather than an array of zeros: every
term is a time >= +0.0, for which 0.0 + x is x bit for bit, so the figures are those of adding the zeros.
"""

from __future__ import annotations

import numpy as np


def _sum(a: np.ndarray | None, b: np.ndarray | None) -> np.ndarray | None:
    """a + b, None standing for zeros: every term here is a time >= +0.0, for which 0.0 + x is x bit for bit,
    so leaving out a zero changes no figure (and saves the passes over it)."""
    return b if a is None else a if b is None else a + b


def uniform_exposed(compute: np.ndarray, pre: np.ndarray | None, post: np.ndarray | None,
                     layers: np.ndarray) -> np.ndarray:
    """Exposed communication of `layers` equal layers (per-layer compute c, a prefetched collective g
    before and a collective q after each; None: none), the closed form of overlap.exposed_s: g + (L - 1)
    max(0, g + q - c) + q; zero when there is nothing to communicate."""
    if pre is None and post is None:
        return np.zeros(np.broadcast_shapes(np.shape(compute), np.shape(layers)))
    c = compute / layers
    g, q = (None if pre is None else pre / layers), (None if post is None else post / layers)
    out = _sum(_sum(g, (layers - 1) * np.maximum(_sum(g, q) - c, 0.0)), q)
    some = post > 0 if pre is None else pre > 0 if post is None else (pre > 0) | (post > 0)
    return np.where(some, out, 0.0)


def exposed(compute, pre, post, layers, overlap_pre: bool, overlap_post: bool, f: float) -> np.ndarray:
    """cost.dataparallel._overlap for equal layers: the overlapped collectives' exposed part, the others
    in full, plus the compute lost to SM contention under the hidden ones (`pre`, `post` None: none)."""
    ov_pre, ov_post = (pre if overlap_pre else None), (post if overlap_post else None)
    shown = uniform_exposed(compute, ov_pre, ov_post, layers)
    serial = _sum(None if overlap_pre else pre, None if overlap_post else post)
    out = shown if serial is None else shown + serial
    hidden = _sum(ov_pre, ov_post)
    return out if hidden is None else out + f * np.maximum(hidden - shown, 0.0)
