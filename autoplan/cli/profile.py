"""`autoplan profile`: measure this machine's (or, under torchrun, this cluster's) compute and
interconnect and write a profile YAML in the shipped format, with a bus-bandwidth plot beside it.

    autoplan profile --out my-cluster.yaml --nproc-per-node 8            # one node, ranks forked here
    torchrun --nnodes 2 --nproc-per-node 8 ... -m autoplan.cli.main profile --out my-cluster.yaml
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "profile",
        help="measure this cluster and write a profile YAML",
        description="Measure matmul/attention/memory throughput with every local rank busy, and the "
        "collectives (all-reduce, all-gather, reduce-scatter, all-to-all, send/recv) per link "
        "level; fit them into a profile that `autoplan plan --cluster FILE` reads.",
    )
    parser.add_argument(
        "--out", default="my-cluster.yaml", help="profile to write (a PNG plot goes beside it)"
    )
    parser.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        help="ranks per node (default: torchrun's, else the GPU count, else 2)",
    )
    parser.add_argument("--nnodes", type=int, default=None, help="nodes (more than 1 needs torchrun)")
    parser.add_argument(
        "--backend",
        choices=("nccl", "gloo"),
        default=None,
        help="default: nccl when CUDA GPUs are visible, else gloo",
    )
    parser.add_argument("--quick", action="store_true", help="fewer shapes and smaller messages (~1 min)")
    parser.add_argument("--name", default=None, help="profile name (default: the --out file's stem)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds any rendezvous or collective may take before the run fails (default 60)",
    )
    parser.set_defaults(func=run)


def _torchrun_env() -> dict[str, int] | None:
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    if not all(k in os.environ for k in keys):
        return None
    return {k: int(os.environ[k]) for k in keys}


def check_writable(out: Path) -> None:
    """Fail before measuring, not after: the directory must exist and take a new file."""
    if out.is_dir():
        raise ValueError(f"--out {out} is a directory: give a file name such as {out / 'my-cluster.yaml'}")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise ValueError(f"cannot write --out {out}: directory {parent} does not exist")
    if out.exists() and not os.access(out, os.W_OK):
        raise ValueError(f"cannot write --out {out}: the file is read-only")
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=f".{out.name}.", suffix=".check"):
            pass
    except OSError as exc:
        raise ValueError(f"cannot write --out {out}: {exc.strerror or exc}") from None


def write_atomic(path: Path, write: Callable[[str], None]) -> None:
    """write(temp_path) then rename over `path`: a failure leaves no half-written file."""
    fd, tmp = tempfile.mkstemp(
        dir=path.parent if str(path.parent) else ".", prefix=f".{path.name}.", suffix=".tmp"
    )
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    try:
        write(tmp)
        os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o666 & ~umask)  # mkstemp makes 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _options(args: argparse.Namespace, env: dict[str, int] | None):
    import torch

    from autoplan.cluster.probe import ProbeOptions

    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if env:
        nproc, nnodes = env["LOCAL_WORLD_SIZE"], env["WORLD_SIZE"] // env["LOCAL_WORLD_SIZE"]
        for flag, given, actual in (
            ("--nproc-per-node", args.nproc_per_node, nproc),
            ("--nnodes", args.nnodes, nnodes),
        ):
            if given is not None and given != actual:
                raise ValueError(
                    f"{flag} {given} disagrees with torchrun's {actual}: drop the flag or fix torchrun's"
                )
    else:
        default = torch.cuda.device_count() if backend == "nccl" else 2
        nproc = default if args.nproc_per_node is None else args.nproc_per_node
        nnodes = 1 if args.nnodes is None else args.nnodes
    return ProbeOptions(
        nproc_per_node=nproc, nnodes=nnodes, backend=backend, quick=args.quick, timeout_s=args.timeout
    )


def run(args: argparse.Namespace) -> int:
    code = _run(args)
    if _torchrun_env() is not None:  # a rank of torchrun's has had a process group
        from autoplan.execute.worker import exit_without_teardown

        exit_without_teardown(code)
    return code


def _run(args: argparse.Namespace) -> int:
    from autoplan.cluster.load import dump_profile
    from autoplan.cluster.probe import ProbeFailed, Rendezvous, probe_local, probe_torchrun
    from autoplan.cluster.report import build_profile, plot_bus_bandwidth, summary_tables

    out = Path(args.out)
    env = _torchrun_env()
    opts = _options(args, env)
    if env is None or env["RANK"] == 0:
        check_writable(out)
    started = time.monotonic()
    try:
        if env is None:
            raw = probe_local(opts)
        else:
            raw = probe_torchrun(
                opts,
                Rendezvous(
                    rank=env["RANK"],
                    world_size=env["WORLD_SIZE"],
                    local_rank=env["LOCAL_RANK"],
                    local_world_size=env["LOCAL_WORLD_SIZE"],
                ),
            )
    except ProbeFailed as exc:
        for rank, text in sorted(exc.tracebacks.items()):
            print(f"--- rank {rank} ---\n{text.rstrip()}", file=sys.stderr)
        print(f"autoplan: error: {exc} (no profile written)", file=sys.stderr)
        return 1
    if raw is None:  # not rank 0 under torchrun
        return 0
    name = args.name or out.stem
    profile = build_profile(raw, name=name)
    environment = raw["env"]
    header = (
        f"Measured by `autoplan profile` on {environment['hostname']}, {environment['date']}: "
        f"{environment['world_size']} ranks, {opts.backend}, torch {environment['torch']}"
        + (
            f", CUDA {environment.get('cuda')}, NCCL {environment.get('nccl')}, driver {environment.get('driver')}"
            if opts.backend == "nccl"
            else ""
        )
        + ("; --quick" if opts.quick else ""),
        "Units: FLOP/s, bytes, bytes/s, seconds. Per device (rank). `measured:` holds the raw medians.",
    )
    text = dump_profile(
        profile.spec,
        comments=profile.comments,
        measured=profile.measured,
        header=header,
        description=f"measured: {environment['world_size']} x {environment['device_name']} ({opts.backend})",
    )
    png = out.with_suffix(".png")
    write_atomic(png, lambda tmp: plot_bus_bandwidth(profile, tmp))
    write_atomic(out, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    from rich.console import Console

    console = Console()
    for table in summary_tables(profile):
        console.print(table)
    if profile.warnings:
        shown = "; ".join(profile.warnings[:6]) + ("; ..." if len(profile.warnings) > 6 else "")
        console.print(
            f"[yellow]warning:[/yellow] {len(profile.warnings)} noisy measurements (IQR/median > 25 %) "
            f"or poor fits, all listed under measured.warnings in {out}: {shown}. "
            "Re-run on a quieter machine for a trustworthy profile."
        )
    console.print(f"wrote {out} and {png} in {time.monotonic() - started:.1f} s")
    return 0
