"""`autoplan run`: train a model under a plan (a plan JSON, or the configuration flags of `autoplan
estimate`) on torchrun-launched ranks, and write the run report. A component plan (`autoplan plan --json`
of a model with components) runs through autoplan.execute_components after the same kind of checks
(execute/component_preflight.py); the flags that only a chain run takes are refused in one line.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from autoplan.cli.plan import add_config_flags, add_engine_flag, config_from_args

_LAUNCHER_FLAGS = ("nnodes", "node_rank", "rdzv_endpoint", "rdzv_backend", "rdzv_id", "master_addr", "master_port")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("run", help="train under a plan with torch.distributed (torchrun)")
    p.add_argument("--plan", metavar="FILE", help="plan JSON from `autoplan plan --json` (or use the config flags)")
    p.add_argument("--model", required=True, help="preset name (see `autoplan models`), path/to/file.py:factory or a "
                                                  "Hugging Face model directory")
    p.add_argument("--weights", metavar="PATH", default=None,
                   help="start from these weights: a safetensors file or a from_pretrained directory (default: a "
                        "Hugging Face --model directory's own; else initialised from --seed)")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps")
    p.add_argument("--nproc-per-node", dest="nproc_per_node", type=int, default=None,
                   help="ranks on this node (default: the plan's device count)")
    p.add_argument("--seed", type=int, default=0, help="same seed, same weights and data under every plan")
    p.add_argument("--report", metavar="FILE", help="write the run report (JSON) here")
    p.add_argument("--data", metavar="FILE", help="train on this token file (.npy, .bin of uint16 as nanoGPT "
                                                  "writes, .pt) instead of synthetic tokens")
    p.add_argument("--trace", action="store_true", help="record the last step's pipeline actions per rank in "
                                                        "the report (for `autoplan timeline --report`)")
    p.add_argument("--global-batch", dest="global_batch", type=int, default=None)
    p.add_argument("--seq-len", dest="seq_len", type=int, default=None)
    p.add_argument("--save-every", dest="save_every", type=int, default=0, metavar="K",
                   help="checkpoint every K steps (needs --checkpoint-dir)")
    p.add_argument("--checkpoint-dir", dest="checkpoint_dir", metavar="DIR")
    p.add_argument("--resume", metavar="DIR", help="start from the newest checkpoint in DIR")
    p.add_argument("--timeout-s", dest="timeout_s", type=float, default=300.0,
                   help="process-group timeout: a hung rank ends the job after this (default 300)")
    p.add_argument("--cluster", default=None, metavar="NAME|FILE",
                   help="profile the prediction is made on, with the config flags (default: local-cpu without "
                        "CUDA, else dgx-h100-80gb); a plan JSON carries its own prediction")
    add_config_flags(p)
    add_engine_flag(p)
    nodes = p.add_argument_group("multi-node (passed to torchrun)")
    for name in _LAUNCHER_FLAGS:
        nodes.add_argument("--" + name.replace("_", "-"), dest=name, default=None)
    p.set_defaults(func=cmd_run)


def _launcher_args(args: argparse.Namespace) -> list[str]:
    out = []
    for name in _LAUNCHER_FLAGS:
        value = getattr(args, name)
        if value is not None:
            out.append(f"--{name.replace('_', '-')}={value}")
    return out


def _config_given(args: argparse.Namespace) -> bool:
    names = ("tp", "pp", "dp", "cp", "ep", "sp", "zero", "microbatch", "schedule", "virtual_stages", "recompute",
             "etp", "eep")
    return any(getattr(args, n, None) is not None for n in names)


def _predicted_plan(args: argparse.Namespace, config: Any, nnodes: int) -> Any:
    """The config wrapped in a Plan carrying the cost model's prediction for it, so the run report puts
    the measured step time next to the predicted one."""
    import torch

    from autoplan.cluster.load import Cluster
    from autoplan.search.api import plan_for

    name = args.cluster or ("dgx-h100-80gb" if torch.cuda.is_available() else "local-cpu")
    per_node, rest = divmod(config.num_devices, nnodes)
    if rest:
        raise ValueError(f"{config.num_devices} ranks do not split evenly over --nnodes {nnodes}")
    cluster = Cluster.load(name, num_nodes=nnodes, devices_per_node=per_node)
    return plan_for(args.model, cluster, config, global_batch=args.global_batch, seq_len=args.seq_len,
                    engine=getattr(args, "engine", None))


def _is_component_plan(path: str) -> bool:
    from pathlib import Path

    from autoplan.plan.components import KIND

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return False  # the chain path reports it in its own words
    return isinstance(data, dict) and data.get("kind") == KIND


# flags a component run does not take: (attribute, flag, why)
_CHAIN_ONLY = (("data", "--data", "component runs draw their own inputs (images and tokens)"),
               ("weights", "--weights", "component runs start from the seeded initialisation"),
               ("resume", "--resume", "component runs do not checkpoint"),
               ("checkpoint_dir", "--checkpoint-dir", "component runs do not checkpoint"),
               ("cluster", "--cluster", "a component plan carries its own prediction"))


def _check_component_flags(args: argparse.Namespace, plan) -> None:
    for name, flag, why in _CHAIN_ONLY:
        if getattr(args, name, None):
            raise ValueError(f"{flag}: {why}; drop it to run the component plan")
    if args.save_every:
        raise ValueError("--save-every: component runs do not checkpoint; drop it to run the component plan")
    if any(getattr(args, n) is not None for n in _LAUNCHER_FLAGS):
        raise ValueError("component plans run on the local ranks of one node: drop the multi-node flags")
    for name, value, planned in (("--global-batch", args.global_batch, plan.global_batch),
                                 ("--seq-len", args.seq_len, plan.seq_len)):
        if value is not None and value != planned:
            raise ValueError(f"{name} {value} differs from the component plan's {planned}: the groups' strategies "
                             f"were made for it; plan again to change it")


def _run_components(args: argparse.Namespace) -> int:
    from autoplan.execute.component_preflight import component_preflight
    from autoplan.execute.component_worker import execute_components
    from autoplan.execute.launch import RunFailed
    from autoplan.plan.components import load_component_plan

    plan = load_component_plan(args.plan)
    _check_component_flags(args, plan)
    component_preflight(plan, args.model, steps=args.steps, nproc_per_node=args.nproc_per_node)
    try:
        report = execute_components(plan, args.model, steps=args.steps, seed=args.seed, report=args.report,
                                    timeout_s=args.timeout_s)
    except RunFailed as exc:
        print(f"autoplan run: FAILED: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({k: report.get(k) for k in ("losses", "step_time_s", "predicted_step_time_s")}))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from autoplan.execute.launch import RunFailed, execute, resolve_model
    from autoplan.execute.preflight import check_run_flags, preflight

    check_run_flags(steps=args.steps, save_every=args.save_every, checkpoint_dir=args.checkpoint_dir,
                    resume=args.resume, data=args.data)
    if args.plan and _config_given(args):
        raise ValueError("give either --plan or configuration flags (--tp, --pp, ...), not both")
    if args.plan and _is_component_plan(args.plan):
        return _run_components(args)
    if args.plan:
        plan: Any = args.plan
    else:
        nnodes = int(args.nnodes or 1)
        devices = args.nproc_per_node * nnodes if args.nproc_per_node else None
        if not args.global_batch or not args.seq_len:
            raise ValueError("without --plan, give --global-batch and --seq-len")
        config = config_from_args(args, devices)
        # every check before the prediction, which captures the model (seconds for a large one)
        spec, meta = resolve_model(args.model, weights=args.weights, seq_len=args.seq_len)
        preflight(config, spec, meta, global_batch=args.global_batch, seq_len=args.seq_len,
                  nproc_per_node=args.nproc_per_node, nnodes=nnodes, data=args.data)
        plan = _predicted_plan(args, config, nnodes)
    try:
        report = execute(plan, args.model, steps=args.steps, nproc_per_node=args.nproc_per_node, seed=args.seed,
                         global_batch=args.global_batch, seq_len=args.seq_len, report=args.report,
                         save_every=args.save_every, checkpoint_dir=args.checkpoint_dir, resume=args.resume,
                         timeout_s=args.timeout_s, launcher_args=_launcher_args(args), data=args.data,
                         weights=args.weights, trace=args.trace)
    except RunFailed as exc:
        print(f"autoplan run: FAILED: {exc}", file=sys.stderr)
        return 1
    summary = {k: report.get(k) for k in ("losses", "step_time_s", "predicted_step_time_s")}
    print(json.dumps(summary))
    return 0
