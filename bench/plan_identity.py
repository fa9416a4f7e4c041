"""The search's results, bit for bit: a fixed set of searches (small and medium jobs, dense and MoE, other
engines, a heterogeneous cluster, a model without tokens) whose every ranked Plan (JSON, notes included)
and every quick-estimate array (sha256 of its bytes) are written to, or compared with, a golden file.

A speed change must leave every figure as it was: write the golden file with the code before the change,
then compare with the code after it (and again after merging a cost-model change, with goldens written by
the merged code before the speed change). Timing is not measured here (bench/plan_speed.py does that).

    python bench/plan_identity.py --write bench/data/plan_identity.json   # the reference
    python bench/plan_identity.py --check bench/data/plan_identity.json   # exits 1 on any difference
    python bench/plan_identity.py --check FILE --only gpt3-1.7b-a100x64   # one job
    python bench/plan_identity.py --check FILE --large                     # with the 1T, 405B, DeepSeek jobs
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name -> (model, cluster profile, nodes, global batch, seq_len, engine, options)
JOBS = {
    "gpt3-1.7b-a100x64": ("gpt3-1.7b", "dgx-a100-80gb", 8, 512, 2048, None, {}),
    "llama3-8b-h100x128": ("llama3-8b", "dgx-h100-80gb", 16, 1024, 4096, None, {}),
    "llama3-70b-h100x512-megatron": ("llama3-70b", "dgx-h100-80gb", 64, 1024, 4096, "megatron-lm", {}),
    "gpt3-18b-a100x256-deepspeed": ("gpt3-18b", "dgx-a100-80gb", 32, 512, 2048, "deepspeed", {}),
    "gpt3-18b-a100x64-torchtitan": ("gpt3-18b", "dgx-a100-80gb", 8, 256, 2048, "torchtitan", {}),
    "mixtral-8x7b-h100x64": ("mixtral-8x7b", "dgx-h100-80gb", 8, 256, 4096, None, {}),
    "deepseek-v3-h100x256": ("deepseek-v3", "dgx-h100-80gb", 32, 1024, 4096, None, {}),
    "gpt3-175b-a100x1024": ("gpt3-175b", "dgx-a100-80gb", 128, 1536, 2048, None, {}),
    "llama3-8b-mixed-a100-h100": ("llama3-8b", "dgx-a100-h100", None, 256, 4096, None, {}),
    "resnet-tiny-a100x8": ("resnet-tiny", "dgx-a100-80gb", 1, 64, 64, None, {}),
    "tiny-moe-tight-fixed": ("tiny-moe", "dgx-a100-80gb", 2, 64, 512, None, {"zero": (0, 3), "max_tp": 4}),
}
# the other reference jobs of bench/plan_speed.py (--large; gpt3-175b is above)
LARGE = {
    "gpt3-1t-a100x3072": ("gpt3-1t", "dgx-a100-80gb", 384, 3072, 2048, None, {}),
    "llama3-405b-h100x16384": ("llama3-405b", "dgx-h100-80gb", 2048, 2048, 8192, None, {}),
    "deepseek-v3-h100x2048": ("deepseek-v3", "dgx-h100-80gb", 256, 15360, 4096, None, {}),
}


def _digest(array) -> str:
    import numpy as np

    a = np.ascontiguousarray(array)
    return f"{a.dtype.str}{a.shape}:" + hashlib.sha256(a.tobytes()).hexdigest()


def run_job(name: str) -> dict:
    """Every ranked plan as JSON and a digest of each array of the search's record (quick estimates)."""
    import autoplan
    from autoplan.plan.io import plan_to_dict
    from autoplan.search.api import load_cluster

    model, profile, nodes, batch, seq, engine, options = {**JOBS, **LARGE}[name]
    cluster = load_cluster(profile) if nodes is None else load_cluster(profile, num_nodes=nodes)
    plans = autoplan.autoplan(model, cluster, global_batch=batch, seq_len=seq, top_k=5, engine=engine, **options)
    quick = plans.candidates["quick"]
    arrays = {f: _digest(getattr(quick, f)) for f in ("step_time_s", "peak_mem_bytes", "act_mem_bytes")}
    exact = sorted(json.dumps([str(c.config), c.stages, [list(x) for x in c.layer_recompute], c.row,
                               repr(c.estimate.step_time_s), repr(c.estimate.peak_mem_bytes)])
                   for c in plans.candidates["exact"])
    return {"plans": [plan_to_dict(p) for p in plans], "quick": arrays, "num_candidates": len(quick.step_time_s),
            "exact": hashlib.sha256("\n".join(exact).encode()).hexdigest()}


def _differences(name: str, want: dict, got: dict) -> list[str]:
    out = []
    for key in ("num_candidates", "quick", "exact"):
        if want[key] != got[key]:
            out.append(f"{name}: {key} differs: {want[key]} != {got[key]}")
    for i, (a, b) in enumerate(zip(want["plans"], got["plans"])):
        if a != b:
            fields = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            out.append(f"{name}: plan #{i + 1} differs in {fields}")
    if len(want["plans"]) != len(got["plans"]):
        out.append(f"{name}: {len(want['plans'])} plans != {len(got['plans'])}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", metavar="FILE")
    mode.add_argument("--check", metavar="FILE")
    parser.add_argument("--only", action="append", choices=sorted({**JOBS, **LARGE}),
                        help="run only this job (repeatable)")
    parser.add_argument("--large", action="store_true", help="also the large reference jobs (minutes)")
    args = parser.parse_args()
    import os

    names = args.only or [*JOBS, *(LARGE if args.large else ())]
    with tempfile.TemporaryDirectory(prefix="autoplan-identity-") as cache:
        os.environ["AUTOPLAN_CACHE_DIR"] = cache  # cold: no graph or layer cost comes from an earlier run
        got = {}
        for name in names:
            got[name] = run_job(name)
            print(f"{name}: {got[name]['num_candidates']:,} candidates, best {got[name]['plans'][0]['config']}",
                  flush=True)
    if args.write:
        Path(args.write).parent.mkdir(parents=True, exist_ok=True)
        old = json.loads(Path(args.write).read_text()) if args.only and Path(args.write).exists() else {}
        Path(args.write).write_text(json.dumps({**old, **got}, indent=1, sort_keys=True) + "\n")
        print(f"wrote {args.write}")
        return
    want = json.loads(Path(args.check).read_text())
    diffs = [d for name in names for d in (_differences(name, want[name], got[name]) if name in want
                                           else [f"{name}: not in {args.check}"])]
    print("\n".join(diffs) if diffs else f"identical: {len(names)} searches, every plan and quick estimate")
    sys.exit(1 if diffs else 0)


if __name__ == "__main__":
    main()
