"""Wall time and peak RSS of capturing big presets on the meta device, each in a fresh subprocess so the
RSS is the capture's own (plus the interpreter and torch import, reported separately).

    python bench/capture_speed.py [preset ...]      # default: llama3-70b llama3-405b
"""

from __future__ import annotations

import json
import subprocess
import sys

_CHILD = r"""
import json, resource, sys, time
import torch
import autoplan.models
from autoplan.graph.capture import capture
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with torch.device("meta"):
    model = autoplan.models.preset(sys.argv[1])
start = time.perf_counter()
graph = capture(model, seq_len=int(sys.argv[2]), microbatch=1)
wall = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
print(json.dumps({"wall_s": wall, "peak_rss_mb": peak / 1024, "import_rss_mb": base / 1024,
                  "layers": len(graph.layers), "params": graph.num_params, "fwd_flops": graph.fwd_flops}))
"""


def measure(name: str, seq_len: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, name, str(seq_len)],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> int:
    names = argv or ["llama3-70b", "llama3-405b"]
    for name in names:
        r = measure(name, 8192 if "llama3" in name else 2048)
        print(
            f"{name:14s} capture {r['wall_s']:6.2f} s  peak RSS {r['peak_rss_mb']:7.0f} MB "
            f"(after import {r['import_rss_mb']:.0f} MB)  {r['layers']} layers  "
            f"{r['params'] / 1e9:.1f} B params  {r['fwd_flops'] / 1e12:.0f} TFLOP fwd"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
