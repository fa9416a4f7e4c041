"""Predict every vTrain ground-truth row (measured Megatron-DeepSpeed iteration times on A100 clusters)
and print the error: MAPE, median APE and the worst rows, single- and multi-node separately.

    python bench/validate_vtrain.py [--worst 8] [--rows] [--groups]

The rows (bench/data/vtrain/*.csv, see its README and LICENSE): GPT with a 4h GELU MLP, vocabulary 50257,
fp16, full recompute on every layer, 1F1B without interleaving, no ZeRO / SP / CP, no gradient
bucketing. Engine: megatron-deepspeed (Megatron's kernels: unfused softmax attention, fused bias-GeLU and
bias-dropout-add; DeepSpeed's engine, pipeline and activation checkpointing; the gradients all-reduced
after the schedule: vTrain's configs set use_gradient_bucket false). Hardware: A100 SXM, 8 per node, NVSwitch, and 800 Gb/s of
InfiniBand per node (4 x 200 Gb/s HDR), half the NICs of a DGX A100: the shipped dgx-a100-80gb profile
with the per-GPU inter-node bandwidth set to 800 Gb/s / 8 = 12.5 GB/s and its all-reduce bus-bandwidth
fraction to the one nccl-tests measured on two such nodes (VTRAIN_NIC_BUSBW_FRACTION; the only changes).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's autoplan

from graphs import gpt_graph
from vtrain_groups import print_groups

from autoplan.cluster.load import Cluster
from autoplan.cluster.types import ClusterSpec
from autoplan.cost import estimate_config
from autoplan.plan.engine import Engine
from autoplan.plan.types import ParallelConfig

VTRAIN = Path(__file__).resolve().parent / "data" / "vtrain"
VOCAB = 50257
VTRAIN_NIC_BYTES_PER_S = 800e9 / 8 / 8  # 4 x 200 Gb/s HDR per node, 8 GPUs: bytes/s per GPU
# nccl-tests all_reduce_perf between two nodes of 8 A100-SXM + 4 x 200 Gb/s HDR (vTrain's node): busbw 91 GB/s
# at 1-8 GB (NVIDIA/nccl-tests issue 100) and 86 GB/s (nccl-tests issue 175) of the 100 GB/s the 4 NICs carry:
# 0.885, below the 0.96 of a DGX A100 with one NIC per GPU (profiles/dgx-a100-80gb.yaml)
VTRAIN_NIC_BUSBW_FRACTION = 0.885


def vtrain_engine() -> Engine:
    """megatron-deepspeed (the codebase the rows were measured with): Megatron-LM's kernels, DeepSpeed's
    pipeline and activation checkpointing, the gradient all-reduce after the schedule."""
    return Engine.load("megatron-deepspeed")


def vtrain_cluster(num_gpus: int) -> ClusterSpec:
    """dgx-a100-80gb with vTrain's 4 HDR NICs per node (12.5 GB/s per GPU, at the bus-bandwidth fraction
    measured on that node shape), fp16; fewer than 8 GPUs form one partial node."""
    per_node = min(num_gpus, 8)
    base = Cluster.load("dgx-a100-80gb", num_nodes=max(num_gpus // 8, 1))
    inter = dataclasses.replace(base.inter_node, bw_bytes_per_s=VTRAIN_NIC_BYTES_PER_S,
                                allreduce_busbw_fraction=VTRAIN_NIC_BUSBW_FRACTION)
    return dataclasses.replace(base, devices_per_node=per_node, num_nodes=max(num_gpus // per_node, 1),
                               inter_node=inter, dtype="fp16", name="vtrain-a100")


def read_rows(name: str) -> list[dict[str, float]]:
    path = VTRAIN / name
    if not path.exists():
        sys.exit(f"validate_vtrain: {path} not found (bench/data/vtrain ships with the repository)")
    with path.open(encoding="utf-8-sig", newline="") as fh:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(fh)]


def padded_vocab(vocab: int, tp: int, divisible_by: int = 128) -> int:
    """The vocabulary Megatron-LM trains with: padded to a multiple of make_vocab_size_divisible_by (128,
    the default) times tp (megatron/training/tokenizer/tokenizer.py, _vocab_size_with_padding), so that the
    vocab-parallel embedding and loss split it evenly."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def predict_s(row: dict[str, float], engine: Engine | None = None) -> float:
    gpus, h, a = int(row["# GPUs"]), int(row["hidden size"]), int(row["attention heads"])
    tp = int(row["tensor parallelism"])
    graph = gpt_graph(h=h, a=a, layers=int(row["# layers"]), seq=int(row["sequence length"]),
                      vocab=padded_vocab(VOCAB, tp))
    config = ParallelConfig(tp=tp, dp=int(row["data parallelism"]),
                            pp=int(row["pipeline parallelism"]), microbatch=int(row["micro batch"]),
                            recompute="full", schedule="1f1b")
    est = estimate_config(graph, vtrain_cluster(gpus), config, global_batch=int(row["global batch"]),
                          engine=engine or vtrain_engine())
    return est.step_time_s


def describe(row: dict[str, float]) -> str:
    key = {"Parameters (billion)": "params(B)", "# GPUs": "gpus", "hidden size": "h", "# layers": "l",
           "tensor parallelism": "t", "data parallelism": "d", "pipeline parallelism": "p",
           "micro batch": "mb", "global batch": "B"}
    return " ".join(f"{short}={row[k]:g}" for k, short in key.items() if k in row)


def row_errors(rows: list[dict[str, float]],
               engine: Engine) -> list[tuple[float, float, float, dict[str, float]]]:
    """(signed error, predicted s, measured s, row) per row; error = predicted / measured - 1."""
    out = []
    for row in rows:
        measured = row["iteration time (ms)"] / 1e3
        predicted = predict_s(row, engine)
        out.append(((predicted - measured) / measured, predicted, measured, row))
    return out


def report(name: str, errors: list[tuple[float, float, float, dict[str, float]]], worst: int,
           show_rows: bool) -> None:
    apes = [abs(e[0]) for e in errors]
    print(f"{name}: {len(errors)} rows  MAPE {100 * statistics.mean(apes):.1f} %  median APE "
          f"{100 * statistics.median(apes):.1f} %  median signed error "
          f"{100 * statistics.median(e[0] for e in errors):+.1f} %")
    listing = errors if show_rows else sorted(errors, key=lambda e: -abs(e[0]))[:worst]
    for err, pred, meas, row in listing:
        print(f"   {100 * err:+6.1f} %  predicted {pred:8.3f} s  measured {meas:8.3f} s  {describe(row)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worst", type=int, default=8, help="worst rows to list per file")
    parser.add_argument("--rows", action="store_true", help="list every row, not only the worst")
    parser.add_argument("--groups", action="store_true",
                        help="also print the signed error grouped by model, t, p, d, micro batch, nodes and "
                             "micro-batch count, and the share of the MAPE the rows past 10 %% carry")
    args = parser.parse_args()
    engine = vtrain_engine()
    for name, file in (("multi-node", "ground_truth_multi.csv"), ("single-node", "ground_truth_single.csv")):
        errors = row_errors(read_rows(file), engine)
        report(name, errors, args.worst, args.rows)
        if args.groups:
            print_groups(errors)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
