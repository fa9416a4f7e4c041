"""Predict the published calibration runs (../shared/calibration/published_calibration.json: Megatron-LM
weak scaling, Narayanan et al. SC'21 Table 1) and print predicted vs published TFLOP/s per GPU.

    python bench/validate_calibration.py

Like with like: the paper's TFLOP/s count the recomputed forward, F = 96 B s l h^2 (1 + s/(6h) +
V/(16 l h)) per iteration, so we divide the same F by the predicted step time. Runs: full recompute,
unfused attention, fp16/bf16 on DGX A100 80GB (the shipped dgx-a100-80gb profile: 8 HDR NICs per node,
as the record says), PyTorch DDP (gradient all-reduce overlapped with the backward) for these <= 18B rows.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
from pathlib import Path

from autoplan.cluster.load import Cluster
from autoplan.cost import estimate_config
from autoplan.plan.types import ParallelConfig

HERE = Path(__file__).resolve().parent
SHARED = HERE.parents[0].parent / "shared"
RECORDS = SHARED / "calibration" / "published_calibration.json"


def _vtrain_module():
    spec = importlib.util.spec_from_file_location("validate_vtrain", HERE / "validate_vtrain.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def megatron_flops(*, B: int, s: int, l: int, h: int, V: int) -> float:
    """Narayanan et al. 2021, appendix: FLOPs per iteration with full recompute."""
    return 96.0 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))


def main() -> int:
    if not RECORDS.exists():
        sys.exit(f"validate_calibration: {RECORDS} not found: the calibration records live in "
                 f"../shared/calibration next to the repository")
    vt = _vtrain_module()
    records = json.loads(RECORDS.read_text())["records"]
    errors = []
    print(f"{'run':28s} {'gpus':>5s} {'t':>2s} {'p':>2s} {'d':>3s} {'mb':>3s} {'published':>9s} "
          f"{'predicted':>9s} {'error':>7s}  TFLOP/s per GPU (recompute counted)")
    for rec in records:
        model, cl, cfg = rec["model"], rec["cluster"], rec["config"]
        gpus = cl["num_gpus"]
        cluster = Cluster.load("dgx-a100-80gb", num_nodes=gpus // cl["gpus_per_node"])
        graph = vt.gpt_graph(h=model["hidden"], a=model["heads"], layers=model["layers"], seq=model["seq_len"],
                             vocab=model["vocab"], ffn=model["ffn_hidden"])
        schedule = "interleaved" if cfg.get("interleave") else "1f1b"
        config = ParallelConfig(tp=cfg["tp"], pp=cfg["pp"], dp=cfg["dp"], microbatch=cfg["microbatch"],
                                recompute="full", schedule=schedule, virtual_stages=cfg.get("interleave") or 1)
        est = estimate_config(graph, cluster, config, global_batch=cfg["global_batch"], overlap_dp=True)
        flops = megatron_flops(B=cfg["global_batch"], s=model["seq_len"], l=model["layers"], h=model["hidden"],
                               V=model["vocab"])
        predicted = flops / est.step_time_s / gpus / 1e12
        published = rec["measured"]["tflops_per_gpu"]
        err = (predicted - published) / published
        errors.append(err)
        print(f"{rec['id']:28s} {gpus:5d} {cfg['tp']:2d} {cfg['pp']:2d} {cfg['dp']:3d} {cfg['microbatch']:3d} "
              f"{published:9.1f} {predicted:9.1f} {100 * err:+6.1f} %   step {est.step_time_s:.2f} s, "
              f"mfu {est.mfu:.3f}, peak mem {est.peak_mem_bytes / 2**30:.1f} GiB")
    print(f"MAPE {100 * statistics.mean(abs(e) for e in errors):.1f} %  over {len(errors)} runs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
