"""`autoplan serve`: rank serving layouts for a model on a cluster (autoplan.serve_plan), print the best
with its vLLM / SGLang launch commands, optionally write JSON and a Pareto plot, and with --run time the
chosen tensor-parallel layout(s) on local gloo ranks next to the prediction.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

_GIB = 2**30


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="rank serving plans (TTFT / TPOT / goodput), optionally run one")
    p.add_argument("--model", required=True, help="preset name, or path/to/file.py:factory")
    p.add_argument("--cluster", required=True, help="profile name (see `autoplan clusters`) or YAML path")
    p.add_argument("--input-len", dest="input_len", type=int, required=True, help="prompt tokens per request")
    p.add_argument("--output-len", dest="output_len", type=int, required=True, help="generated tokens per request")
    load = p.add_mutually_exclusive_group(required=True)
    load.add_argument("--concurrency", type=int, help="clients in a closed loop")
    load.add_argument("--rate", type=float, help="Poisson arrivals, requests/s")
    p.add_argument("--burstiness", type=float, default=None, metavar="K",
                   help="with --rate: gamma shape of arrival gaps (1 = Poisson, < 1 burstier; vLLM benchmark_serving's "
                        "--burstiness); != 1 evaluates the queue by discrete-event simulation")
    p.add_argument("--simulate", action="store_true", default=None,
                   help="evaluate the queue by discrete-event simulation instead of Little's law")
    p.add_argument("--ttft-slo", dest="ttft_slo", type=float, default=None, metavar="S", help="TTFT limit, seconds")
    p.add_argument("--tpot-slo", dest="tpot_slo", type=float, default=None, metavar="S", help="TPOT limit, seconds")
    p.add_argument("--engine", default=None, metavar="NAME|PATH", help="vllm (default), sglang, tensorrt-llm, or a YAML")
    p.add_argument("--top-k", dest="top_k", type=int, default=5)
    p.add_argument("--json", metavar="FILE", help="write the ranked plans as JSON")
    p.add_argument("--plot", metavar="FILE", help="write the Pareto plot (PNG): tokens/s per GPU vs per user")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--devices-per-node", dest="devices_per_node", type=int, default=None)
    p.add_argument("--dtype", default=None, help="weight dtype: bf16 (default on GPUs), fp8, ...")
    p.add_argument("--kv-dtype", dest="kv_dtype", default=None, help="KV-cache dtype (default: the activations')")
    for name in ("tp", "pp", "ep", "replicas", "max-batch"):
        p.add_argument(f"--{name}", dest=name.replace("-", "_"), type=int, nargs="+", default=None, metavar="N",
                       help=f"restrict the search to these {name} values")
    p.add_argument("--images-per-request", dest="images_per_request", type=int, default=None, metavar="N",
                   help="a model with an encoder (tiny-llava, llava-1.5-7b): images each request sends (default 1)")
    for name in ("encoder-tp", "encoder-replicas"):
        p.add_argument(f"--{name}", dest=name.replace("-", "_"), type=int, nargs="+", default=None, metavar="N",
                       help=f"restrict the search to these {name} values (encoder-replicas 0: the encoder runs "
                            f"on the prefill devices)")
    split = p.add_mutually_exclusive_group()
    split.add_argument("--aggregated-only", dest="disaggregated", action="store_false", default=None)
    split.add_argument("--disaggregated-only", dest="disaggregated", action="store_true")
    run = p.add_argument_group("run the plan on local gloo ranks (a static batch of --concurrency prompts)")
    run.add_argument("--run", action="store_true",
                     help="time each --tp x --pp layout (else the best plan's) for real on local gloo ranks")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--repeats", type=int, default=3, help="timed runs after one warm-up (median)")
    p.set_defaults(func=cmd_serve)


def _options(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"num_nodes": args.nodes}
    for name in ("devices_per_node", "dtype", "kv_dtype", "tp", "pp", "ep", "replicas", "max_batch", "disaggregated",
                 "burstiness", "simulate", "images_per_request", "encoder_tp", "encoder_replicas"):
        value = getattr(args, name)
        if value is not None:
            out[name] = tuple(value) if isinstance(value, list) else value
    return out


def _check(args: argparse.Namespace) -> None:
    for name in ("input_len", "output_len", "top_k", "nodes", "concurrency", "repeats"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    if args.images_per_request is not None and args.images_per_request < 0:
        raise ValueError(f"--images-per-request must be 0 or more, got {args.images_per_request}")
    if args.run and (args.images_per_request or args.encoder_tp or args.encoder_replicas):
        raise ValueError("--run times a language model's decode loop: it has no encoder stage (drop --run or the "
                         "encoder flags)")
    if args.burstiness is not None and not args.burstiness > 0:
        raise ValueError(f"--burstiness must be a positive number (1 = Poisson), got {args.burstiness}")
    if args.burstiness is not None and args.rate is None:
        raise ValueError("--burstiness shapes open-loop arrivals: give --rate, not --concurrency")
    if args.run and args.concurrency is None:
        raise ValueError("--run times a static batch of --concurrency prompts: give --concurrency, not --rate")
    if args.run and ":" in args.model:
        raise ValueError("--run builds a preset (e.g. tiny-llama): give a preset name as --model")


def cmd_serve(args: argparse.Namespace) -> int:
    from autoplan.serve.api import serve_plan

    _check(args)
    plans = serve_plan(args.model, args.cluster, input_len=args.input_len, output_len=args.output_len,
                       concurrency=args.concurrency, rate=args.rate, ttft_slo_s=args.ttft_slo,
                       tpot_slo_s=args.tpot_slo, engine=args.engine, top_k=args.top_k, **_options(args))
    print(plans.table())
    best = plans.best
    print(best.explain())
    if plans.min_devices is not None:
        print(f"smallest device count that fits and holds the load: {plans.min_devices}")
    for engine, roles in (("vLLM", best.vllm_args()), ("SGLang", best.sglang_args())):
        for role, argv in roles.items():
            print(f"{engine} {role}: {' '.join(argv)}")
    if args.json:
        data = {"plans": [p.to_dict() for p in plans], "min_devices": plans.min_devices}
        with open(args.json, "w") as f:
            json.dump(data, f, indent=2, default=str)
        print(f"plans written to {args.json}")
    if args.plot:
        print(f"Pareto plot written to {plans.plot(args.plot)}")
    if args.run:
        return _run(args, plans)
    return 0


def _run(args: argparse.Namespace, plans: Any) -> int:
    """Time each tp x pp layout of the --tp and --pp values (else the best plan's) with the decode loop
    of autoplan.execute.serve, next to the prediction for that loop: the torch-eager engine on the
    cluster profile scaled to the run's ranks on this machine's cores (autoplan.serve.local)."""
    from autoplan.execute.launch import RunFailed
    from autoplan.execute.serve import run_serve

    layouts = [(tp, pp) for pp in sorted(set(args.pp or [plans.best.config.pp]))
               for tp in sorted(set(args.tp or [plans.best.config.tp]))]
    rows = []
    for tp, pp in layouts:
        ttft, tpot = _predict_run(args, tp, pp)
        try:
            measured = run_serve(args.model, tp=tp, pp=pp, batch=args.concurrency, input_len=args.input_len,
                                 output_len=args.output_len, seed=args.seed, repeats=args.repeats,
                                 out=open(os.devnull, "w"))  # noqa: SIM115 - closed with the process
        except RunFailed as exc:
            print(f"autoplan serve --run: FAILED at tp={tp} pp={pp}: {exc}", file=sys.stderr)
            return 1
        rows.append((f"{tp}x{pp}" if pp > 1 else str(tp), ttft, tpot, measured["ttft_s"], measured["tpot_s"]))
    print(f"--run: {args.model}, static batch {args.concurrency}, {args.input_len} in / {args.output_len} out, "
          f"gloo ranks on {os.cpu_count()} cores (timings are noisy while the machine is shared)")
    print(f"{'tp':>5} {'TTFT pred ms':>13} {'TTFT meas ms':>13} {'TPOT pred ms':>13} {'TPOT meas ms':>13}")
    for name, pt, pp_, mt, mp in rows:
        print(f"{name:>5} {pt * 1e3:>13.2f} {mt * 1e3:>13.2f} {pp_ * 1e3:>13.2f} {mp * 1e3:>13.2f}")
    pred_order = [r[0] for r in sorted(rows, key=lambda r: r[2])]
    meas_order = [r[0] for r in sorted(rows, key=lambda r: r[4])]
    verdict = "matches" if pred_order == meas_order else "DIFFERS from"
    label = "tp" if all("x" not in r[0] for r in rows) else "tp x pp"
    print(f"TPOT order by {label}, fastest first: predicted {pred_order}, measured {meas_order}: the prediction "
          f"{verdict} the measurement")
    return 0


def _predict_run(args: argparse.Namespace, tp: int, pp: int = 1) -> tuple[float, float]:
    from autoplan.search.api import load_cluster
    from autoplan.serve.api import load_serving
    from autoplan.serve.estimate import static_batch
    from autoplan.serve.local import scale_for_ranks

    # one micro-batch: one stage (its tp ranks) computes at a time
    cluster = scale_for_ranks(load_cluster(args.cluster), ranks=tp * pp, cores=os.cpu_count() or 1, busy=tp)
    model, hw = load_serving(args.model, cluster, "torch-eager")  # the loop runs in the profile's dtype
    ttft, tpot, _ = static_batch(model, hw, tp=tp, pp=pp, batch=args.concurrency, input_len=args.input_len,
                                 output_len=args.output_len)
    return ttft, tpot
