"""Times the profiler's acceptance runs on this machine and prints wall time and load:
`autoplan profile --nproc-per-node 2 --quick` (target < 1 min) and `--nproc-per-node 8` (< 5 min).

    python bench/profile_timing.py [--only-quick] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run(nproc: int, quick: bool, out_dir: Path) -> tuple[float, int]:
    out = out_dir / f"local-{nproc}rank{'-quick' if quick else ''}.yaml"
    cmd = [
        sys.executable,
        "-m",
        "autoplan.cli.main",
        "profile",
        "--nproc-per-node",
        str(nproc),
        "--out",
        str(out),
    ]
    start = time.monotonic()
    proc = subprocess.run(cmd + (["--quick"] if quick else []), capture_output=True, text=True, check=False)
    wall = time.monotonic() - start
    if proc.returncode != 0:
        print(proc.stderr[-2000:], file=sys.stderr)
    return wall, proc.returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only-quick", action="store_true")
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args()
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="autoplan-bench-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    cases = [(2, True)] + ([] if args.only_quick else [(8, False)])
    for nproc, quick in cases:
        load_before = os.getloadavg()[0]
        wall, rc = run(nproc, quick, out_dir)
        limit = 60 if quick else 300
        print(
            f"profile --nproc-per-node {nproc}{' --quick' if quick else ''}: {wall:.1f} s wall "
            f"(limit {limit} s, rc {rc}), load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}, "
            f"{os.cpu_count()} cores; profile in {out_dir}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
