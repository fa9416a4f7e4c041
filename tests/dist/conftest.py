"""tests/dist: multi-rank gloo tests. Every test here is marked `dist`; the harness (harness.py) forks
the ranks with a FileStore and kills them on a deadline, so a failure never hangs the suite."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/dist/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.dist)
