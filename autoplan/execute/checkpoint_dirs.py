"""The directory layout of checkpoints, without torch (so the checks before a launch stay fast): a root holds
`step-00000010/` directories, each complete once DCP's coordinator wrote its `.metadata` (execute.checkpoint)."""

from __future__ import annotations

import os
import re
from pathlib import Path

_STEP_DIR = re.compile(r"^step-(\d+)$")
_METADATA = ".metadata"  # written last by DCP's coordinator


def _step_of(directory: Path) -> int | None:
    match = _STEP_DIR.match(directory.name)
    return int(match.group(1)) if match else None


def _is_complete(directory: Path) -> bool:
    return (directory / _METADATA).is_file()


def latest_checkpoint(path: str | os.PathLike) -> Path | None:
    """`path` itself if it is a complete checkpoint, else its complete `step-N` subdirectory with the highest
    N, else None. Directories being written (`.step-N.tmp`) or removed (`.step-N.old`) never qualify."""
    root = Path(path)
    if _is_complete(root):
        return root
    if not root.is_dir():
        return None
    complete = [d for d in root.iterdir() if _step_of(d) is not None and _is_complete(d)]
    return max(complete, key=_step_of, default=None)  # type: ignore[arg-type,return-value]
