"""Every test run caches captured graphs in its own temporary directory, never in the user's cache."""

from __future__ import annotations

import os
import tempfile

import pytest


@pytest.fixture(autouse=True, scope="session")
def _private_graph_cache():
    with tempfile.TemporaryDirectory(prefix="autoplan-test-cache-") as tmp:
        old = os.environ.get("AUTOPLAN_CACHE_DIR")
        os.environ["AUTOPLAN_CACHE_DIR"] = tmp
        yield tmp
        if old is None:
            os.environ.pop("AUTOPLAN_CACHE_DIR", None)
        else:
            os.environ["AUTOPLAN_CACHE_DIR"] = old
