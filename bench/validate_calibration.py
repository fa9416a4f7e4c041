"""Predict the published calibration runs (bench/data/calibration/published_calibration.json: Megatron-LM
weak scaling, Narayanan et al. SC'21 Table 1) and the per-layer times of Korthikanti et al. 2022 Table 4
(bench/data/calibration/korthikanti_layer_times.json), and print the published comparisons (ZeRO-3 vs
PTD-P, Llama 3 405B).

    python bench/validate_calibration.py

Like with like: the SC'21 TFLOP/s count the recomputed forward, F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h))
per iteration, so we divide the same F by the predicted step time. Runs: full recompute, fp16 (the
scripts' --fp16), engine megatron-lm with PyTorch DDP (gradient all-reduce overlapped with the backward:
--DDP-impl torch for these <= 18B rows), on DGX A100 80GB (the shipped profile: 8 HDR NICs per node).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's autoplan

from graphs import gpt_graph
from published import Result, megatron_flops

from autoplan.cluster.load import Cluster
from autoplan.cost import estimate_config, estimate_layer
from autoplan.plan.engine import Engine
from autoplan.plan.types import ParallelConfig

CALIBRATION = Path(__file__).resolve().parent / "data" / "calibration"


def calibration_results() -> list[Result]:
    records = json.loads((CALIBRATION / "published_calibration.json").read_text())["records"]
    engine = dataclasses.replace(Engine.load("megatron-lm"), dp_comm_overlap=True)  # --DDP-impl torch
    out = []
    for rec in records:
        model, cl, cfg = rec["model"], rec["cluster"], rec["config"]
        gpus = cl["num_gpus"]
        cluster = dataclasses.replace(Cluster.load("dgx-a100-80gb", num_nodes=gpus // cl["gpus_per_node"]),
                                      dtype="fp16")
        graph = gpt_graph(h=model["hidden"], a=model["heads"], layers=model["layers"], seq=model["seq_len"],
                          vocab=model["vocab"], ffn=model["ffn_hidden"])
        schedule = "interleaved" if cfg.get("interleave") else "1f1b"
        config = ParallelConfig(tp=cfg["tp"], pp=cfg["pp"], dp=cfg["dp"], microbatch=cfg["microbatch"],
                                recompute="full", schedule=schedule, virtual_stages=cfg.get("interleave") or 1)
        est = estimate_config(graph, cluster, config, global_batch=cfg["global_batch"], engine=engine)
        flops = megatron_flops(B=cfg["global_batch"], s=model["seq_len"], l=model["layers"], h=model["hidden"],
                               V=model["vocab"])
        measured = flops / (rec["measured"]["tflops_per_gpu"] * 1e12 * gpus)
        out.append(Result(set="calibration", label=rec["id"], engine="megatron-lm", predicted_s=est.step_time_s,
                          measured_s=measured, fits=est.fits, estimate=est))
    return out


def korthikanti_results() -> list[Result]:
    """One block of the 22B GPT (h 6144, 64 heads, s 2048, tp 8, microbatch 4) on a DGX A100, forward +
    backward per setting, against Table 4's measured totals (Megatron-LM 2022 kernels: megatron-lm)."""
    data = json.loads((CALIBRATION / "korthikanti_layer_times.json").read_text())
    m, run = data["model"], data["run"]
    block = gpt_graph(h=m["hidden"], a=m["heads"], layers=1, seq=m["seq_len"], vocab=m["vocab"]).blocks[0]
    cluster = Cluster.load("dgx-a100-80gb")
    # Megatron-LM of 2022 (their code): the column-parallel backward collectives run async beside the
    # weight-gradient GEMM (--async-tensor-model-parallel-allreduce, on by default since 2021-09; with SP
    # the reduce-scatter always)
    engine = dataclasses.replace(Engine.load("megatron-lm"), tp_bwd_overlap=True)
    out = []
    for row in data["rows"]:
        config = ParallelConfig(tp=run["tp"], sp=row["sp"], microbatch=run["microbatch"], recompute=row["recompute"])
        cost = estimate_layer(block, cluster, config, row["recompute"], seq_len=m["seq_len"], engine=engine)
        out.append(Result(set="korthikanti-layer", label=row["setting"], engine="megatron-lm",
                          predicted_s=cost.time_s, measured_s=row["total_ms"] / 1e3))
    return out


def main() -> int:
    for result in calibration_results() + korthikanti_results():
        print(f"{result.set:18s} {result.label:42s} predicted {result.predicted_s:9.4f} s  measured "
              f"{result.measured_s:9.4f} s  {100 * result.error:+6.1f} %")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
