"""Serving predictions against published measurements: prints each row's prediction and error, the
median error per metric, and whether the predicted ordering of TP choices matches the published one.

    python bench/serve_accuracy.py [--csv bench/data/serving/measurements.csv] [--verbose] [--simulate]

Data: bench/data/serving/measurements.csv (one published figure per row), sources.json (each source's
URL, title and conditions), models.json (shapes beyond the presets). Nothing is fitted: the model
reads only the cluster profiles, the engine profiles and the model shapes.
Modes: "static" = a lockstep batch (vLLM benchmark_latency, TensorRT-LLM gptSessionBenchmark:
prefill all prompts, then decode the whole batch; throughput = batch x output / latency / tp);
"closed" = `load` clients in a closed loop (genai-perf / AIPerf --concurrency), steady state.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
from collections import defaultdict
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DATA = ROOT / "bench" / "data" / "serving"


@cache
def _graph(name: str):
    import torch

    from autoplan.graph.capture import capture
    from autoplan.models import PRESETS
    from autoplan.models.config import TransformerConfig
    from autoplan.models.transformer import Transformer
    from autoplan.search.api import model_graph

    if name in PRESETS:
        return model_graph(name, 32)
    spec = {k: v for k, v in json.loads((DATA / "models.json").read_text())[name].items() if k != "source"}
    with torch.device("meta"):
        model = Transformer(TransformerConfig(name=name, **spec))
    return capture(model, seq_len=32, microbatch=1, model_name=name)


def predict(row: dict, simulate: bool = False) -> float:
    """The model's figure for one measurement row, in the row's unit."""
    from autoplan.serve.api import load_serving, serve_estimate
    from autoplan.serve.estimate import static_batch

    tp, load, i, o = int(row["tp"]), int(row["load"]), int(row["input_len"]), int(row["output_len"])
    options = {"dtype": row["dtype"], "kv_dtype": row["kv_dtype"]}
    graph = _graph(row["model"])
    if row["mode"] == "static":
        model, hw = load_serving(graph, row["cluster"], row["engine"], **options)
        ttft, tpot, e2e = static_batch(model, hw, tp=tp, batch=load, input_len=i, output_len=max(o, 1))
        values = {"ttft_ms": ttft * 1e3, "tpot_ms": tpot * 1e3, "e2e_ms": e2e * 1e3,
                  "tput_per_gpu": load * o / e2e / tp}
        return values[row["metric"]]
    est = serve_estimate(graph, row["cluster"], {"tp": tp, "max_batch": 2048}, input_len=i, output_len=o,
                         concurrency=load, engine=row["engine"], simulate=simulate, **options)
    return {"ttft_ms": est.ttft_s * 1e3, "tpot_ms": est.tpot_s * 1e3,
            "tput_per_gpu": est.tokens_per_s_per_gpu}[row["metric"]]


def _ordering(rows: list[dict]) -> tuple[int, int, int, int]:
    """(groups whose full TP ordering matches, groups, agreeing TP pairs, pairs) over rows that differ
    only in tp. Latencies order low-to-high, throughputs high-to-low alike (sign of pairwise differences)."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        key = tuple(r[k] for k in ("source", "model", "cluster", "mode", "load", "input_len", "output_len", "metric"))
        groups[key].append(r)
    full = total = agree = pairs = 0
    for members in groups.values():
        if len({m["tp"] for m in members}) < 2:
            continue
        total += 1
        ok = True
        members.sort(key=lambda m: int(m["tp"]))
        for a in range(len(members)):
            for b in range(a + 1, len(members)):
                ma, mb = float(members[a]["value"]), float(members[b]["value"])
                pa, pb = members[a]["pred"], members[b]["pred"]
                pairs += 1
                same = (ma - mb) * (pa - pb) > 0
                agree += same
                ok &= same
        full += ok
        if not ok:
            print("  TP order differs: " + " ".join(f"tp{m['tp']} {float(m['value']):.1f}/{m['pred']:.1f}" for m in members)
                  + f"  ({members[0]['source']} {members[0]['model']} {members[0]['cluster']} x{members[0]['load']} "
                  f"{members[0]['metric']}, measured/predicted)")
    return full, total, agree, pairs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--csv", default=str(DATA / "measurements.csv"))
    p.add_argument("--verbose", action="store_true", help="print every row")
    p.add_argument("--simulate", action="store_true",
                   help="closed-loop rows by the discrete-event simulation instead of Little's law + M/D/1")
    args = p.parse_args(argv)
    with open(args.csv, newline="") as f:
        rows = list(csv.DictReader(f))
    errors: dict[str, list[float]] = defaultdict(list)
    by_source: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        r["pred"] = predict(r, args.simulate)
        meas = float(r["value"])
        err = r["pred"] / meas - 1 if math.isfinite(r["pred"]) else math.inf
        r["err"] = err
        errors[r["metric"]].append(abs(err))
        by_source[r["source"]].append(abs(err))
        if args.verbose:
            print(f"{r['source']:<22} {r['engine']:<12} {r['model']:<12} {r['cluster']:<14} tp{r['tp']:<2} "
                  f"{r['dtype']:<5} {r['mode']:<6} x{r['load']:<5} {r['input_len']:>5}/{r['output_len']:<5} "
                  f"{r['metric']:<13} measured {meas:>10.1f}  predicted {r['pred']:>10.1f}  {err:+7.1%}")
    print(f"{len(rows)} published measurements, {len(by_source)} sources (bench/data/serving/sources.json)")
    print("median |error| by metric:")
    for metric, errs in sorted(errors.items()):
        print(f"  {metric:<13} {statistics.median(errs):6.1%}  ({len(errs)} rows; 90th percentile "
              f"{sorted(errs)[int(0.9 * (len(errs) - 1))]:.1%})")
    print("median |error| by source:")
    for source, errs in sorted(by_source.items()):
        print(f"  {source:<24} {statistics.median(errs):6.1%}  ({len(errs)} rows)")
    full, total, agree, pairs = _ordering(rows)
    print(f"TP ordering: {full} of {total} groups in the published order; {agree} of {pairs} TP pairs agree")
    signed = [r["err"] for r in rows if math.isfinite(r["err"])]
    print(f"bias: median signed error {statistics.median(signed):+.1%} (negative: predictions too fast)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
