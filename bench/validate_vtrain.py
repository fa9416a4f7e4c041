"""Predict every vTrain ground-truth row (measured Megatron-DeepSpeed iteration times on A100 clusters)
and print the error: MAPE, median APE and the worst rows, single- and multi-node separately.

    python bench/validate_vtrain.py [--worst 8] [--rows]

The rows (../shared/validation/vtrain/*.csv, see its README): GPT with a 4h GELU MLP, vocabulary 50257,
fp16, full recompute on every layer, 1F1B without interleaving, no ZeRO / SP / CP, no gradient
bucketing (Megatron's local DDP all-reduces the gradient buffer after the schedule: overlap_dp=False).
Hardware: A100 SXM, 8 per node, NVSwitch, and 800 Gb/s of InfiniBand per node (4 x 200 Gb/s HDR), half
the NICs of a DGX A100: we take the shipped dgx-a100-80gb profile and set the per-GPU inter-node
bandwidth to 800 Gb/s / 8 = 12.5 GB/s (the only change). Attention is Megatron's unfused
softmax + dropout (the scores are stored: Korthikanti et al. 2022's 5 a s / h term).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import statistics
import sys
from pathlib import Path

from autoplan.cluster.load import Cluster
from autoplan.cluster.types import ClusterSpec
from autoplan.cost import estimate_config
from autoplan.graph.types import Layer, LayerGraph, LayerRole
from autoplan.plan.types import ParallelConfig

SHARED = Path(__file__).resolve().parent / "data"
VTRAIN = SHARED / "vtrain"
VOCAB = 50257
VTRAIN_NIC_BYTES_PER_S = 800e9 / 8 / 8  # 4 x 200 Gb/s HDR per node, 8 GPUs: bytes/s per GPU
# Host time per eager op: the profile's device.op_overhead_s (sourced there), not a bench constant.
# Forward ops of one Megatron GPT layer (ParallelTransformerLayer, fused kernels), counted in its
# code: norm, QKV linear, 5 views/splits, 3 transposes, baddbmm (+ its empty), view, fused softmax,
# RNG-tracker fork + dropout (3), 3 views, bmm, permute + contiguous, view, output linear, all-reduce,
# bias-dropout-add (3), norm, fc1, bias-GELU, fc2, all-reduce, bias-dropout-add (3): 40.
BLOCK_OPS, EMBED_OPS, HEAD_OPS = 40, 8, 16


def gpt_graph(*, h: int, a: int, layers: int, seq: int, vocab: int, b: int = 1, ffn: int | None = None,
              unfused_attention: bool = True) -> LayerGraph:
    """Megatron GPT as a LayerGraph from the published formulas, for microbatch b.

    Blocks: FLOPs 24 b s h^2 (matmuls) + 4 b s^2 h (attention core) (Narayanan et al. 2021, appendix),
    parameters 12 h^2 + 13 h, activations s b h (34 + 5 a s / h) with the 5 a s^2 b scores when the
    attention is unfused (Korthikanti et al. 2022); causal (GPT), but unfused attention computes the
    whole square and masks it, so causality does not change its cost. Embedding: (V + s) h parameters
    (word + learned positions), read rows + add positions + dropout: ~8 s b h bytes. Head: the V x h projection
    (2 b s h V FLOPs; tied to the embedding, but the last pipeline stage keeps its own copy, so its
    parameters are counted) and Megatron's vocab-parallel cross entropy in fp32: logits stored
    2 + 4 bytes each, and about 24 bytes of traffic per logit (fp16 write, max, subtract, exp, sum,
    divide passes)."""
    s, f = seq, ffn or 4 * h
    tok = b * s
    scores = 5 * a * s * s * b if unfused_attention else 0
    params = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
    block = {
        "kind": "block", "role": LayerRole.BLOCK, "fwd_matmul_flops": 2.0 * tok * (4 * h * h + 2 * h * f),
        "fwd_attention_flops": 4.0 * b * s * s * h, "fwd_elementwise_flops": 10.0 * tok * h,
        "num_params": params, "param_bytes": 2 * params, "activation_bytes": 34 * tok * h + scores,
        "attention_activation_bytes": scores, "causal_attention": True, "input_bytes": 2 * tok * h,
        "output_bytes": 2 * tok * h,
        "hidden_size": h, "num_heads": a, "num_kv_heads": a, "ffn_hidden_size": f, "num_nodes": BLOCK_OPS,
    }
    out = [Layer(name="embed", kind="embed", role=LayerRole.EMBEDDING, index=0, fwd_matmul_flops=0.0,
                 fwd_attention_flops=0.0, fwd_elementwise_flops=float(tok * h), num_params=(vocab + s) * h,
                 param_bytes=2 * (vocab + s) * h, activation_bytes=tok * h, output_bytes=2 * tok * h,
                 bytes_moved=8 * tok * h, num_nodes=EMBED_OPS)]
    out += [Layer(name=f"layers.{i}", index=i + 1, **block) for i in range(layers)]
    out.append(Layer(name="head", kind="head", role=LayerRole.HEAD, index=layers + 1,
                     fwd_matmul_flops=2.0 * tok * h * vocab, fwd_attention_flops=0.0,
                     fwd_elementwise_flops=5.0 * tok * vocab, num_params=vocab * h + 2 * h,
                     param_bytes=2 * (vocab * h + 2 * h), activation_bytes=4 * tok * h + 6 * tok * vocab,
                     input_bytes=2 * tok * h, output_bytes=4 * b, bytes_moved=24 * tok * vocab,
                     num_nodes=HEAD_OPS))
    return LayerGraph(model_name=f"gpt-h{h}-l{layers}", layers=tuple(out), seq_len=s, microbatch=b,
                      vocab_size=vocab)


def vtrain_cluster(num_gpus: int) -> ClusterSpec:
    """dgx-a100-80gb with vTrain's 4 HDR NICs per node (12.5 GB/s per GPU), fp16; fewer than 8 GPUs
    form one partial node."""
    per_node = min(num_gpus, 8)
    base = Cluster.load("dgx-a100-80gb", num_nodes=max(num_gpus // 8, 1))
    inter = dataclasses.replace(base.inter_node, bw_bytes_per_s=VTRAIN_NIC_BYTES_PER_S)
    return dataclasses.replace(base, devices_per_node=per_node, num_nodes=max(num_gpus // per_node, 1),
                               inter_node=inter, dtype="fp16", name="vtrain-a100")


def read_rows(name: str) -> list[dict[str, float]]:
    path = VTRAIN / name
    if not path.exists():
        sys.exit(f"validate_vtrain: {path} not found: the vTrain data lives in ../shared/validation/vtrain "
                 f"next to the repository (see its README)")
    with path.open(encoding="utf-8-sig", newline="") as fh:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(fh)]


def predict_s(row: dict[str, float]) -> float:
    gpus, h, a = int(row["# GPUs"]), int(row["hidden size"]), int(row["attention heads"])
    graph = gpt_graph(h=h, a=a, layers=int(row["# layers"]), seq=int(row["sequence length"]), vocab=VOCAB)
    config = ParallelConfig(tp=int(row["tensor parallelism"]), dp=int(row["data parallelism"]),
                            pp=int(row["pipeline parallelism"]), microbatch=int(row["micro batch"]),
                            recompute="full", schedule="1f1b")
    est = estimate_config(graph, vtrain_cluster(gpus), config, global_batch=int(row["global batch"]),
                          overlap_dp=False)
    return est.step_time_s


def report(name: str, rows: list[dict[str, float]], worst: int, show_rows: bool) -> None:
    errors = []
    for row in rows:
        measured = row["iteration time (ms)"] / 1e3
        predicted = predict_s(row)
        errors.append(((predicted - measured) / measured, predicted, measured, row))
    apes = [abs(e[0]) for e in errors]
    signed = statistics.mean(e[0] for e in errors)
    print(f"{name}: {len(rows)} rows  MAPE {100 * statistics.mean(apes):.1f} %  median APE "
          f"{100 * statistics.median(apes):.1f} %  mean signed error {100 * signed:+.1f} %")
    key = {"Parameters (billion)": "B", "# GPUs": "gpus", "hidden size": "h", "# layers": "l",
           "tensor parallelism": "t", "data parallelism": "d", "pipeline parallelism": "p",
           "micro batch": "mb", "global batch": "B"}
    listing = errors if show_rows else sorted(errors, key=lambda e: -abs(e[0]))[:worst]
    for err, pred, meas, row in listing:
        desc = " ".join(f"{short}={row[k]:g}" for k, short in key.items() if k in row)
        desc = desc.replace("B=", "params(B)=", 1) if "Parameters (billion)" in row else desc
        print(f"   {100 * err:+6.1f} %  predicted {pred:8.3f} s  measured {meas:8.3f} s  {desc}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worst", type=int, default=8, help="worst rows to list per file")
    parser.add_argument("--rows", action="store_true", help="list every row, not only the worst")
    args = parser.parse_args()
    report("multi-node", read_rows("ground_truth_multi.csv"), args.worst, args.rows)
    report("single-node", read_rows("ground_truth_single.csv"), args.worst, args.rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
