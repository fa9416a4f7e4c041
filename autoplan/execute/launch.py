"""Launch a plan on ranks with torchrun, and say clearly which rank failed when one does.

`execute(plan_or_config, model, steps=...)` (the Python API, also `autoplan.execute`) writes the plan
JSON, runs `python -m torch.distributed.run --standalone --nproc-per-node K -m autoplan.execute.worker`
and returns the run report. A failing job raises RunFailed naming the first rank that failed on its
own (its traceback), else a rank killed by a signal, else a hung rank (its stack), else the first
communication error. Multi-node: each node's launcher sees its own ranks' error files only.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from autoplan.plan.types import ParallelConfig, Plan

# messages of errors a rank gets because another rank died or hung (not its own failure)
_PEER_FAILURE_MARKS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "imed out",
                       "Socket Timeout", "NCCL communicator was aborted", "DistNetworkError", "DistStoreError")
# what C++ prints before it aborts a process (std::terminate, and an exception's what()), one rank's or another's:
# the launcher's output interleaves the ranks, so it is quoted beside the signal, not attributed
_NATIVE_ABORT = re.compile(r"^(terminate called [^\n]*|\s*what\(\):[^\n]*)$", re.MULTILINE)
_TORCHRUN_FAILURE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


class RunFailed(RuntimeError):
    """The job ended with a failing rank; `rank` is the one to blame (None when unknown)."""

    def __init__(self, message: str, *, rank: int | None) -> None:
        super().__init__(message)
        self.rank = rank


def read_plan(path: str | Path, *, global_batch: int | None = None,
              seq_len: int | None = None) -> tuple[Plan | ParallelConfig, int, int]:
    """A saved Plan (autoplan.plan.io) or {"config": {...}, "global_batch": B, "seq_len": S}; explicit
    global_batch / seq_len override the file's."""
    from autoplan.plan.io import plan_from_dict

    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"plan {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or "config" not in data:
        raise ValueError(f"plan {path} has no 'config' object: write it with autoplan.plan.io.save_plan")
    plan: Plan | ParallelConfig = plan_from_dict(data) if "schema_version" in data else \
        ParallelConfig.from_dict(data["config"])
    global_batch = global_batch or data.get("global_batch")
    seq_len = seq_len or data.get("seq_len")
    if not global_batch or not seq_len:
        raise ValueError(f"plan {path} gives no global_batch / seq_len: pass --global-batch and --seq-len")
    return plan, int(global_batch), int(seq_len)


def write_plan(plan_or_config: Plan | ParallelConfig, path: str | Path, *, global_batch: int | None,
               seq_len: int | None) -> None:
    from autoplan.plan.io import plan_to_dict

    if isinstance(plan_or_config, Plan):
        data = plan_to_dict(plan_or_config)
    else:
        data = {"config": plan_or_config.to_dict()}
    if global_batch:
        data["global_batch"] = global_batch
    if seq_len:
        data["seq_len"] = seq_len
    Path(path).write_text(json.dumps(data, indent=2) + "\n")


def torchrun_command(worker_args: Sequence[str], *, nproc_per_node: int,
                     launcher_args: Sequence[str] = (), module: str = "autoplan.execute.worker") -> list[str]:
    """torchrun (as `python -m torch.distributed.run`) around the worker module (the training worker,
    or autoplan.execute.serve's decode loop); --standalone unless the launcher arguments configure a
    multi-node rendezvous (--nnodes, --rdzv-endpoint, ...)."""
    multi_node = any(a.startswith(("--nnodes", "--rdzv", "--master")) for a in launcher_args)
    cmd = [sys.executable, "-m", "torch.distributed.run", *([] if multi_node else ["--standalone"]),
           f"--nproc-per-node={nproc_per_node}", *launcher_args, "-m", module]
    return cmd + list(worker_args)


def run_torchrun(cmd: Sequence[str], *, run_dir: str, env: Mapping[str, str] | None = None,
                 out: TextIO | None = None) -> None:
    """Run the launcher, echoing its output; on a non-zero exit raise RunFailed with the diagnosis."""
    out = out or sys.stdout
    tail: collections.deque[str] = collections.deque(maxlen=400)
    with subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, **(env or {})}) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            tail.append(line)
        code = proc.wait()
    if code != 0:
        rank, message = diagnose(run_dir, "".join(tail))
        raise RunFailed(message, rank=rank)


def _is_peer_failure(error: Mapping[str, Any]) -> bool:
    text = f"{error['type']}: {error['message']}"
    return any(mark in text for mark in _PEER_FAILURE_MARKS)


def diagnose(run_dir: str, launcher_output: str) -> tuple[int | None, str]:
    """(rank to blame, message) from the ranks' error files and torchrun's failure summary."""
    errors = sorted((json.loads(Path(p).read_text()) for p in glob.glob(os.path.join(run_dir, "error-*.json"))),
                    key=lambda e: e["time"])
    own = [e for e in errors if not _is_peer_failure(e)]
    if own:
        e = own[0]
        return e["rank"], f"rank {e['rank']} failed: {e['type']}: {e['message']}\n{e['traceback']}"
    for rank, code in ((int(r), int(c)) for r, c in _TORCHRUN_FAILURE.findall(launcher_output)):
        if code < 0 and -code != signal.SIGTERM:
            name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
            native = _NATIVE_ABORT.findall(launcher_output)
            said = f"; the output has the native abort {' / '.join(dict.fromkeys(native))!r}" if native else ""
            return rank, (f"rank {rank} died: killed by signal {name} (the process had no chance to report "
                          f"a Python traceback){said}; the other ranks were stopped")
    if errors:
        e = errors[0]
        stopped = _stopped_ranks(run_dir, errors)
        if stopped:
            rank, stack = stopped[0]
            return rank, (f"rank {rank} hung: it reported no error and was still running when the launcher "
                          f"stopped the job after rank {e['rank']} failed waiting for it ({e['type']}: "
                          f"{e['message']}); rank {rank}'s stack when stopped:\n{stack}")
        return e["rank"], f"rank {e['rank']} failed: {e['type']}: {e['message']}\n{e['traceback']}"
    return None, "the job failed without any rank reporting an error; the launcher said:\n" + \
        "".join(launcher_output.splitlines(keepends=True)[-40:])


def _stopped_ranks(run_dir: str, errors: list[Mapping[str, Any]]) -> list[tuple[int, str]]:
    """(rank, stack) of the ranks that reported no error but dumped their stack on the launcher's SIGTERM."""
    failed = {e["rank"] for e in errors}
    out = []
    for path in glob.glob(os.path.join(run_dir, "stack-*.txt")):
        rank, stack = int(Path(path).stem.split("-")[1]), Path(path).read_text()
        if rank not in failed and stack.strip():
            out.append((rank, stack))
    return sorted(out)


def launcher_nnodes(launcher_args: Sequence[str]) -> int | None:
    """--nnodes of the torchrun arguments (1 when absent; None when elastic, "MIN:MAX")."""
    for i, arg in enumerate(launcher_args):
        if arg.startswith("--nnodes"):
            value = arg.split("=", 1)[1] if "=" in arg else (launcher_args[i + 1] if i + 1 < len(launcher_args) else "")
            return int(value) if value.isdigit() else None
    return 1


_RESOLVED: dict[tuple[str, str | None, int], tuple[Any, Any]] = {}


def resolve_model(model: Any, *, weights: str | Path | None = None, seq_len: int = 16) -> tuple[Any, Any]:
    """(ModelSpec the ranks build from, the model on the meta device for the checks); names are resolved once.
    `seq_len`: the run's, which a model without tokens is traced at (source.model_spec)."""
    from autoplan.execute.source import model_spec

    if not isinstance(model, str):
        return model_spec(model, weights=str(weights) if weights else None, seq_len=seq_len)
    key = (model, str(weights) if weights else None, seq_len)
    if key not in _RESOLVED:
        _RESOLVED[key] = model_spec(model, weights=key[1], seq_len=seq_len)
    return _RESOLVED[key]


def _ship_model(spec: Any, model: Any, run_dir: str, args: list[str]) -> Any:
    """Write what the ranks need of a non-preset model into the run directory: the spec (with the skeleton of a
    module given from Python) and, for a module with real weights and no weights file, its weights."""
    import dataclasses

    import torch
    from torch import nn

    from autoplan.execute.source import has_real_weights
    from autoplan.execute.weights import save_weights

    if isinstance(model, nn.Module) and spec.weights is None and has_real_weights(model):
        path = os.path.join(run_dir, "weights.safetensors")
        save_weights(model, path)
        spec = dataclasses.replace(spec, weights=path)
    spec_path = os.path.join(run_dir, "model-spec.pt")
    torch.save(spec, spec_path)
    args += ["--model-spec", spec_path]
    return spec


def _worker_env(env: Mapping[str, str] | None) -> dict[str, str]:
    """The ranks import what this process imports: its sys.path goes first on theirs (a skeleton's classes)."""
    paths = [p for p in sys.path if p and os.path.isdir(p)]
    given = {**os.environ, **(env or {})}.get("PYTHONPATH", "")
    return {**(env or {}), "PYTHONPATH": os.pathsep.join([*paths, *([given] if given else [])])}


def execute(plan_or_config: Plan | ParallelConfig | str | Path, model: Any, *, steps: int,
            nproc_per_node: int | None = None, seed: int = 0, global_batch: int | None = None,
            seq_len: int | None = None, report: str | Path | None = None, save_every: int = 0,
            checkpoint_dir: str | None = None, resume: str | None = None, timeout_s: float = 300.0,
            launcher_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
            out: TextIO | None = None, data: str | Path | None = None,
            weights: str | Path | None = None, trace: bool = False) -> dict[str, Any]:
    """Train `model` under a plan, config or plan JSON path on torchrun-launched ranks; returns the run report
    (also written to `report` when given). Raises RunFailed if a rank fails.

    `model`: a preset name, "path/to/file.py:factory", a Hugging Face from_pretrained directory or an nn.Module
    (its weights are trained; one built on the meta device is initialised from `seed`). `weights`: a
    safetensors file or directory to start from (each rank reads its own shards). `data`: a token file (.npy,
    .bin, .pt) to train on instead of synthetic tokens. `trace`: record the last step's pipeline actions per
    rank in the report's "timeline" (execute.trace). Every check of execute.preflight runs here first: a
    mistake is one ValueError line, before any rank starts."""
    from autoplan.execute.preflight import check_run_flags, preflight

    check_run_flags(steps=steps, save_every=save_every, checkpoint_dir=checkpoint_dir, resume=resume,
                    data=str(data) if data else None)
    if isinstance(plan_or_config, (str, Path)):
        plan, global_batch, seq_len = read_plan(plan_or_config, global_batch=global_batch, seq_len=seq_len)
    else:
        plan = plan_or_config
        if isinstance(plan, Plan):
            global_batch, seq_len = global_batch or plan.global_batch, seq_len or plan.seq_len
        if not global_batch or not seq_len:
            raise ValueError("give global_batch and seq_len (--global-batch, --seq-len) with a bare configuration")
    spec, meta = resolve_model(model, weights=weights, seq_len=seq_len)
    config = plan.config if isinstance(plan, Plan) else plan
    preflight(plan, spec, meta, global_batch=global_batch, seq_len=seq_len, nproc_per_node=nproc_per_node,
              nnodes=launcher_nnodes(launcher_args) or 1, data=str(data) if data else None)
    with tempfile.TemporaryDirectory(prefix="autoplan-run-") as run_dir:
        plan_path = os.path.join(run_dir, "plan.json")
        write_plan(plan, plan_path, global_batch=global_batch, seq_len=seq_len)
        report_path = str(report) if report else os.path.join(run_dir, "report.json")
        args = ["--plan", plan_path, "--model", spec.name, "--steps", str(steps), "--seed", str(seed),
                "--report", report_path, "--run-dir", run_dir, "--timeout-s", str(timeout_s),
                "--save-every", str(save_every)]
        args += ["--checkpoint-dir", checkpoint_dir] if checkpoint_dir else []
        args += ["--resume", resume] if resume else []
        args += ["--trace"] if trace else []
        args += ["--data", str(Path(data).resolve())] if data else []
        if not spec.is_preset:
            spec = _ship_model(spec, model, run_dir, args)
            env = _worker_env(env)
        cmd = torchrun_command(args, nproc_per_node=nproc_per_node or config.num_devices,
                               launcher_args=launcher_args)
        run_torchrun(cmd, run_dir=run_dir, env=env, out=out)
        return json.loads(Path(report_path).read_text())
