"""`autoplan plan`, `autoplan estimate`, `autoplan models`, `autoplan clusters`, `autoplan engines`: flags ->
the API.

`autoplan plan` takes one flag per SearchOptions field (SEARCH_FLAGS) and writes the outputs a user asks
for: --json (every ranked plan), --csv, --pareto (PNG) and --export ENGINE FILE (the best plan). A model
with components (a vision tower + projector + language model: tiny-llava, llava-1.5-7b, tiny-policy) is
planned with autoplan.plan_components (cli/plan_components.py): one device group per component, the
same search flags applied to every group; --chain plans it as one chain instead.

`add_config_flags(parser)` / `config_from_args(args, num_devices)` define the ParallelConfig flags once,
for `estimate` here and for `autoplan run`.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path
from typing import Any

from autoplan.plan.export import ENGINES
from autoplan.plan.types import ParallelConfig, Recompute, Schedule

_GIB = 2**30
_CONFIG_KEYS = ("tp", "pp", "dp", "cp", "ep", "sp", "zero", "microbatch", "schedule", "virtual_stages", "recompute",
                "etp", "eep")


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """--tp --pp --dp --cp --ep --sp --zero --microbatch --schedule --virtual-stages --recompute."""
    group = parser.add_argument_group("parallel configuration (omitted: defaults; dp: the rest of the devices)")
    for name in ("tp", "pp", "dp", "cp", "ep"):
        group.add_argument(f"--{name}", type=int, default=None, metavar="N", help=f"{name} degree")
    group.add_argument("--sp", action="store_true", default=None, help="sequence parallelism over the tp group")
    group.add_argument("--zero", type=int, default=None, metavar="N", help="ZeRO stage 0-3")
    group.add_argument("--microbatch", type=int, default=None, metavar="N", help="sequences per microbatch")
    group.add_argument("--schedule", default=None, metavar="S", help="|".join(s.value for s in Schedule))
    group.add_argument("--virtual-stages", dest="virtual_stages", type=int, default=None, metavar="V",
                       help="model chunks per pipeline rank (interleaved / zb)")
    group.add_argument("--recompute", default=None, metavar="R", help="|".join(r.value for r in Recompute))
    group.add_argument("--etp", type=int, default=None, metavar="N",
                       help="MoE folding: expert tensor-parallel degree (default: tp)")
    group.add_argument("--eep", type=int, default=None, metavar="N",
                       help="MoE folding: expert-parallel degree over the stage's ranks (default: ep)")


def config_from_args(args: argparse.Namespace, num_devices: int) -> ParallelConfig:
    """The ParallelConfig the flags describe (ValueError, one line, on bad values)."""
    given = {k: getattr(args, k) for k in _CONFIG_KEYS if getattr(args, k, None) is not None}
    return ParallelConfig.from_dict(given, num_devices=num_devices)


def _add_job_flags(parser: argparse.ArgumentParser, *, need_batch: bool = True) -> None:
    parser.add_argument("--model", required=True, help="preset name, or path/to/file.py:factory")
    parser.add_argument("--cluster", required=True, help="profile name (see `autoplan clusters`) or YAML path")
    parser.add_argument("--nodes", type=int, default=1, help="number of nodes (default 1)")
    parser.add_argument("--devices-per-node", dest="devices_per_node", type=int, default=None)
    parser.add_argument("--global-batch", dest="global_batch", type=int, required=need_batch,
                        help="sequences per optimizer step")
    parser.add_argument("--seq-len", dest="seq_len", type=int, required=True, help="tokens per sequence")
    add_engine_flag(parser)


def add_engine_flag(parser: argparse.ArgumentParser) -> None:
    """--engine NAME|PATH: the training engine the estimate is for (see `autoplan engines`)."""
    parser.add_argument("--engine", default=None, metavar="NAME|PATH",
                        help="training engine the plan is priced for: a shipped name (see `autoplan engines`) "
                             "or an engine YAML file (default: autoplan's own executor)")


# SearchOptions field -> its `autoplan plan` flag: one flag per field, nothing else (a test checks it)
SEARCH_FLAGS = {
    "global_batch": "--global-batch", "top_k": "--top-k", "tp": "--tp", "pp": "--pp", "dp": "--dp", "cp": "--cp",
    "ep": "--ep", "microbatch": "--microbatch", "zero": "--zero", "sp": "--sp", "schedules": "--schedules",
    "recompute": "--recompute", "max_virtual_stages": "--max-virtual-stages", "max_tp": "--max-tp",
    "use_ilp": "--no-ilp", "progress": "--quiet", "etp": "--etp", "eep": "--eep", "fold_experts": "--no-fold",
    "zero_with_pp": "--zero-with-pp", "zero0_1d_only": "--zero0-1d-only",
}
_LIST_FLAGS = ("tp", "pp", "dp", "cp", "ep", "microbatch", "zero", "sp", "schedules", "recompute", "etp", "eep",
               "zero_with_pp")


def _add_search_flags(parser: argparse.ArgumentParser) -> None:
    """The SearchOptions constraints; comma lists restrict a choice (`--tp 4,8`), one value fixes it."""
    g = parser.add_argument_group("search constraints (omitted: searched over; a comma list restricts)")
    for name in ("tp", "pp", "dp", "cp", "ep", "microbatch"):
        g.add_argument(f"--{name}", default=None, metavar="N[,N]", help=f"{name} degree(s) to consider"
                       if name != "microbatch" else "microbatch size(s): sequences per microbatch per replica")
    g.add_argument("--max-tp", dest="max_tp", type=int, default=None, metavar="N", help="tp at most N")
    g.add_argument("--zero", default=None, metavar="Z[,Z]", help="ZeRO stage(s) among 0,1,2,3")
    g.add_argument("--zero-with-pp", dest="zero_with_pp", default=None, metavar="Z[,Z]",
                   help="ZeRO stage(s) where pp > 1, among --zero (default: those the engine runs with a pipeline)")
    g.add_argument("--zero0-1d-only", dest="zero0_1d_only", action="store_true", default=None,
                   help="zero 0 only where data parallelism is the only dimension (default: as the engine runs it)")
    g.add_argument("--sp", default=None, metavar="on|off|on,off", help="sequence parallelism (default: both)")
    g.add_argument("--schedules", default=None, metavar="S[,S]", help="pipeline schedules among "
                   + ",".join(s.value for s in Schedule))
    g.add_argument("--recompute", default=None, metavar="R[,R]", help="recompute modes among "
                   + ",".join(r.value for r in Recompute))
    g.add_argument("--max-virtual-stages", dest="max_virtual_stages", type=int, default=None, metavar="V",
                   help="at most V model chunks per pipeline rank (default 8)")
    g.add_argument("--no-ilp", dest="use_ilp", action="store_false", default=None,
                   help="skip the per-layer recompute and stage split refinement (ILP)")
    g.add_argument("--quiet", dest="progress", action="store_false", default=True, help="no progress line on stderr")
    g.add_argument("--etp", default=None, metavar="N[,N]", help="expert tensor-parallel degree(s) of folded MoE "
                   "layouts (default 1, what `autoplan run` executes)")
    g.add_argument("--eep", default=None, metavar="N[,N]", help="expert-parallel degree(s) of folded MoE layouts "
                   "(default: every divisor of the experts)")
    g.add_argument("--no-fold", dest="fold_experts", action="store_false", default=None,
                   help="no folded MoE layouts: experts only on the dense mesh's ep axis")


def _split_list(flag: str, text: str, convert: Any) -> tuple[Any, ...]:
    out = []
    for item in str(text).split(","):
        try:
            out.append(convert(item.strip()))
        except ValueError:
            raise ValueError(f"{flag} takes a comma list, got {text!r} (bad item {item.strip()!r})") from None
    return tuple(out)


def _on_off(item: str) -> bool:
    if item.lower() not in ("on", "off", "true", "false"):
        raise ValueError(item)
    return item.lower() in ("on", "true")


def search_options(args: argparse.Namespace) -> dict[str, Any]:
    """The SearchOptions keyword arguments the flags give (ValueError, one line, on a bad list)."""
    out: dict[str, Any] = {}
    for name, flag in SEARCH_FLAGS.items():
        value = getattr(args, name, None)
        if value is None:
            continue
        if name in _LIST_FLAGS:
            convert = {"sp": _on_off, "schedules": str, "recompute": str}.get(name, int)
            value = _split_list(flag, value, convert)
        out[name] = value
    return out


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("plan", help="rank the fastest parallel plans that fit",
                              description="Rank the fastest parallel plans that fit. Outputs: a table (with a "
                              "legend), the best plan explained, and on request --json (every ranked plan), "
                              "--csv, --pareto (PNG) and --export (the best plan as an engine's flags or file).")
    _add_job_flags(p)
    p.add_argument("--top-k", dest="top_k", type=int, default=5, help="distinct layouts to rank (default 5)")
    _add_search_flags(p)
    out = p.add_argument_group("outputs")
    out.add_argument("--json", metavar="FILE", help="every ranked plan as JSON: the best plan's fields at the top "
                     "(what `autoplan run --plan FILE` reads) and all plans under \"ranked\"")
    out.add_argument("--csv", metavar="FILE", help="the ranked plans as CSV, one row each")
    out.add_argument("--pareto", metavar="FILE.png", help="plot step time against memory for the candidates")
    out.add_argument("--export", nargs=2, action="append", metavar=("ENGINE", "FILE"), default=None,
                     help=f"write the best plan for an engine ({'|'.join(ENGINES)}): Megatron-LM flags as a bash "
                     "array, a torchtitan TOML, a DeepSpeed JSON; repeatable")
    from autoplan.cli.plan_components import add_component_flags

    add_component_flags(p)
    p.set_defaults(func=cmd_plan)
    e = subparsers.add_parser("estimate", help="predict one configuration, with its breakdown")
    _add_job_flags(e)
    add_config_flags(e)
    e.set_defaults(func=cmd_estimate)
    m = subparsers.add_parser("models", help="list the model presets")
    m.set_defaults(func=cmd_models)
    c = subparsers.add_parser("clusters", help="list the cluster profiles")
    c.set_defaults(func=cmd_clusters)
    g = subparsers.add_parser("engines", help="list the shipped training engines")
    g.set_defaults(func=cmd_engines)


def _cluster(args: argparse.Namespace) -> Any:
    from autoplan.search.api import load_cluster

    for name in ("nodes", "devices_per_node", "global_batch", "seq_len", "top_k", "max_tp", "max_virtual_stages"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    extra = {"devices_per_node": args.devices_per_node} if args.devices_per_node else {}
    return load_cluster(args.cluster, num_nodes=args.nodes, **extra)


def _engine(args: argparse.Namespace) -> Any:
    """The --engine flag as an Engine (ValueError, one line, for an unknown name or a bad file)."""
    from autoplan.plan.engine import as_engine

    return as_engine(getattr(args, "engine", None))


def _print(renderable: Any) -> None:
    from rich.console import Console

    Console(width=200).print(renderable)


def _check_outputs(args: argparse.Namespace) -> None:
    """Bad output requests fail before the search starts."""
    for engine, _ in args.export or ():
        if engine.lower() not in ENGINES:
            raise ValueError(f"--export: unknown engine {engine!r}: choose one of {', '.join(ENGINES)}")
    if args.pareto and not args.pareto.lower().endswith(".png"):
        raise ValueError(f"--pareto writes a PNG: give a FILE.png, got {args.pareto!r}")


def cmd_plan(args: argparse.Namespace) -> int:
    from autoplan.cli.plan_components import cmd_plan_components, plans_components
    from autoplan.graph import named

    if plans_components(args):
        return cmd_plan_components(args, search_options(args), _cluster(args))
    _check_outputs(args)
    options = search_options(args)
    # a cold preset is captured in a forked child from here on, while this process imports the search and
    # loads the cluster (graph/named.py); nothing above imports numpy or torch
    named.prefetch(args.model, args.seq_len)
    try:
        for module in ("rich.console", "rich.table"):  # the table's printer: imported while a child captures
            importlib.import_module(module)
        from autoplan.search.api import autoplan

        cluster = _cluster(args)
        plans = autoplan(args.model, cluster, seq_len=args.seq_len, engine=_engine(args), **options)
    finally:
        named.discard()  # no capture child outlives the command: killed when it failed first, else reaped
    _print(plans.table())
    print(plans[0].explain())
    _write_outputs(args, plans)
    return 0


def _write_outputs(args: argparse.Namespace, plans: Any) -> None:
    from autoplan.plan.export import export_plan
    from autoplan.plan.io import plans_to_json
    from autoplan.search.table import plans_csv

    if args.json:
        Path(args.json).write_text(plans_to_json(plans))
        print(f"{len(plans)} ranked plans written to {args.json} (the best at the top level)")
    if args.csv:
        Path(args.csv).write_text(plans_csv(plans))
        print(f"{len(plans)} ranked plans written to {args.csv}")
    if args.pareto:
        plans.pareto_png(args.pareto)
        print(f"step time against memory plotted in {args.pareto}")
    for engine, path in args.export or ():
        out = export_plan(plans[0], engine)
        Path(path).write_text(out.text)
        print(f"plan #1 exported for {out.engine} to {path}" + (":" if out.notes else ""))
        for note in out.notes:
            print(f"  not expressible in {out.engine}: {note}")


def cmd_estimate(args: argparse.Namespace) -> int:
    from autoplan.search.api import estimate

    cluster = _cluster(args)
    config = config_from_args(args, cluster.num_devices)
    est = estimate(args.model, cluster, config, global_batch=args.global_batch, seq_len=args.seq_len,
                   engine=_engine(args))
    devices = (" + ".join(f"{g.num_devices} x {g.spec.device.name}" for g in cluster.groups) if cluster.groups
               else f"{cluster.num_devices} x {cluster.device.name}")
    print(f"{args.model} on {devices}, global batch {args.global_batch}, seq {args.seq_len}")
    print("config: " + ", ".join(f"{k}={v}" for k, v in config.to_dict().items()))
    print(f"step {est.step_time_s:.4f} s, {est.tokens_per_s:,.0f} tokens/s, MFU {est.mfu:.1%}, "
          f"memory {est.peak_mem_bytes / _GIB:.1f} of {est.mem_capacity_bytes / _GIB:.0f} GiB per device"
          + ("" if est.fits else " -- DOES NOT FIT"))
    print("time per step:")
    for k, v in est.breakdown.items():
        print(f"  {k:<10} {v:10.4f} s  {v / (est.step_time_s or 1):6.1%}")
    print("memory per device:")
    for k, v in est.memory.to_dict().items():
        print(f"  {k:<12} {v / _GIB:8.2f} GiB")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from autoplan.models import PRESETS

    print(f"{'name':<14} {'family':<6} {'layers':>6} {'hidden':>6} {'heads':>5} {'kv':>3} {'experts':>7}  vocab")
    for name, c in PRESETS.items():
        print(f"{name:<14} {c.family:<6} {c.num_layers:>6} {c.hidden_size:>6} {c.num_heads:>5} {c.num_kv_heads:>3} "
              f"{c.num_experts:>7}  {c.vocab_size}")
    return 0


def cmd_clusters(args: argparse.Namespace) -> int:
    from autoplan.cluster.load import Cluster

    for name in Cluster.names():
        c = Cluster.load(name)
        if c.groups:  # heterogeneous: its node groups, in rank order
            print(f"{name:<16} " + " + ".join(f"{g.spec.num_nodes} x {g.name}" for g in c.groups)
                  + f", {c.inter_group.name} between groups")
            continue
        print(f"{name:<16} {c.device.name:<18} {c.devices_per_node} per node, {c.device.mem_bytes / _GIB:.0f} GiB, "
              f"{c.intra_node.name} / {c.inter_node.name}")
    return 0


def cmd_engines(args: argparse.Namespace) -> int:
    from autoplan.plan.engine import Engine

    print(f"{'name':<18} {'attention':<9} {'zero':<7} {'zero pp>1':<9} {'schedules (pp>1)':<26} {'zero3':<9} "
          f"{'tp overlap':<10} {'dp overlap':<10} {'zero 0 alone':<12} description")
    for name in Engine.names():
        e = Engine.load(name)
        print(f"{name:<18} {e.attention:<9} {','.join(map(str, e.zero_stages)):<7} "
              f"{','.join(map(str, e.zero_stages_at(2))):<9} {','.join(e.schedules):<26} {e.zero3:<9} "
              f"{str(e.tp_comm_overlap).lower():<10} {str(e.dp_comm_overlap).lower():<10} "
              f"{str(e.zero0_1d_only).lower():<12} {e.description}")
    return 0
