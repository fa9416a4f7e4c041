"""One formula for the exact model's floats and the quick estimate's numpy arrays of candidates
(search/*): what turns an elementwise numpy result back into the plain float the exact model carries, and
max(x, 0) of either."""

from __future__ import annotations

from typing import Any

import numpy as np


def scalar(x: Any) -> Any:
    """A plain float for the exact model's scalars (numpy's elementwise functions return numpy floats or 0-d
    arrays for them); arrays as they are."""
    return float(x) if np.ndim(x) == 0 else x


def nonnegative(x: Any) -> Any:
    """max(x, 0) of a number or, elementwise, of a numpy array."""
    return np.maximum(x, 0.0) if isinstance(x, np.ndarray) else max(x, 0.0)
