"""search/exposed.py leaves out a collective that is not there (None) instead of adding zeros: the same bits
as the closed forms computed with arrays of zeros (written out here as they were), for every overlap setting."""

from __future__ import annotations

import itertools

import numpy as np

from autoplan.search.exposed import exposed, uniform_exposed


def _uniform_with_zeros(compute, pre, post, layers):
    c, g, q = compute / layers, pre / layers, post / layers
    out = g + (layers - 1) * np.maximum(g + q - c, 0.0) + q
    return np.where((pre > 0) | (post > 0), out, 0.0)


def _exposed_with_zeros(compute, pre, post, layers, overlap_pre, overlap_post, f):
    zeros = np.zeros_like(compute)
    ov_pre, ov_post = (pre if overlap_pre else zeros), (post if overlap_post else zeros)
    shown = _uniform_with_zeros(compute, ov_pre, ov_post, layers)
    hidden = np.maximum(ov_pre + ov_post - shown, 0.0)
    serial = (zeros if overlap_pre else pre) + (zeros if overlap_post else post)
    return shown + serial + f * hidden


def test_leaving_out_a_missing_collective_changes_no_bit() -> None:
    rng = np.random.default_rng(4)
    shape = (200, 8)

    def times():  # non-negative times over many magnitudes, a fifth of them exactly zero
        return np.where(rng.random(shape) < 0.2, 0.0, rng.random(shape) * 10.0 ** rng.integers(-6, 3, shape))

    compute, f = times(), rng.random(shape)
    layers = rng.integers(1, 12, (1, shape[1])).astype(float)
    zeros = np.zeros(shape)
    for pre, post in itertools.product((times(), None), repeat=2):
        full_pre, full_post = (zeros if pre is None else pre), (zeros if post is None else post)
        want = _uniform_with_zeros(compute, full_pre, full_post, layers)
        assert uniform_exposed(compute, pre, post, layers).tobytes() == want.tobytes()
        for overlap_pre, overlap_post in itertools.product((True, False), repeat=2):
            want = _exposed_with_zeros(compute, full_pre, full_post, layers, overlap_pre, overlap_post, f)
            got = exposed(compute, pre, post, layers, overlap_pre, overlap_post, f)
            assert got.shape == want.shape and got.tobytes() == want.tobytes(), (pre is None, post is None,
                                                                                 overlap_pre, overlap_post)
