"""The per-rank entry that torchrun starts: `python -m autoplan.execute.worker --plan F --model M ...`.

Initialises the process group (cuda+nccl when CUDA is present, else cpu+gloo) with a bounded timeout,
trains, and has rank 0 write the report. A failing rank writes its own traceback to
<run-dir>/error-<rank>.json; on SIGTERM (torchrun stopping the job) each rank dumps its stack to
<run-dir>/stack-<rank>.txt, so a hung rank shows where it hung.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import NoReturn

# test hook only: make rank KILL_RANK fail at the start of step KILL_STEP, by FAULT: "kill" (SIGKILL,
# the default), "hang" (sleep for an hour) or "raise" (a RuntimeError)
KILL_RANK_ENV, KILL_STEP_ENV, FAULT_ENV = "AUTOPLAN_TEST_KILL_RANK", "AUTOPLAN_TEST_KILL_STEP", "AUTOPLAN_TEST_FAULT"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="autoplan.execute.worker")
    p.add_argument("--plan", required=True, help="plan JSON (a saved Plan, or {'config': ...})")
    p.add_argument("--model", required=True, help="preset name (or the name of the model in --model-spec)")
    p.add_argument("--model-spec", dest="model_spec", default=None,
                   help="a ModelSpec saved by the launcher (any model that is not a preset)")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--global-batch", dest="global_batch", type=int, default=None)
    p.add_argument("--seq-len", dest="seq_len", type=int, default=None)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", dest="weight_decay", type=float, default=0.01)
    p.add_argument("--save-every", dest="save_every", type=int, default=0)
    p.add_argument("--checkpoint-dir", dest="checkpoint_dir", default=None)
    p.add_argument("--resume", default=None)
    p.add_argument("--data", default=None, help="token file (.npy, .bin uint16, .pt); default synthetic")
    p.add_argument("--report", default=None)
    p.add_argument("--trace", action="store_true", help="record the pipeline's action timestamps in the report")
    p.add_argument("--run-dir", dest="run_dir", required=True, help="where ranks write error files")
    p.add_argument("--timeout-s", dest="timeout_s", type=float, default=300.0,
                   help="process-group timeout: a rank stuck in a collective fails after this")
    return p.parse_args(argv)


def _kill_hook(rank: int) -> Callable[[int], None] | None:
    """Test hook: inject a fault into this rank at the start of a step, when the environment says so."""
    if os.environ.get(KILL_RANK_ENV) is None or os.environ.get(KILL_STEP_ENV) is None:
        return None
    kill_rank, kill_step = int(os.environ[KILL_RANK_ENV]), int(os.environ[KILL_STEP_ENV])
    fault = os.environ.get(FAULT_ENV, "kill")
    if fault not in ("kill", "hang", "raise"):
        raise ValueError(f"{FAULT_ENV}={fault!r}: use kill, hang or raise")

    def hook(step: int) -> None:
        if rank != kill_rank or step != kill_step:
            return
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault == "hang":
            time.sleep(3600)
        else:
            raise RuntimeError(f"injected failure on rank {rank} at step {step}")

    return hook


def _run(args: argparse.Namespace, rank: int) -> None:
    import torch
    import torch.distributed as dist

    from autoplan.execute.launch import read_plan
    from autoplan.execute.train import TrainOptions, report, train

    plan, global_batch, seq_len = read_plan(args.plan, global_batch=args.global_batch, seq_len=args.seq_len)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=args.timeout_s))
    options = TrainOptions(steps=args.steps, global_batch=global_batch, seq_len=seq_len, seed=args.seed,
                           lr=args.lr, weight_decay=args.weight_decay, save_every=args.save_every,
                           checkpoint_dir=args.checkpoint_dir, resume=args.resume, data=args.data,
                           trace=args.trace)
    model = torch.load(args.model_spec, weights_only=False) if args.model_spec else args.model
    result = train(model, plan, options, device=device, on_step=_kill_hook(rank))
    peaks: list[int] = [0] * dist.get_world_size()
    dist.all_gather_object(peaks, result.peak_mem_bytes)
    traces: list[list] = [[] for _ in range(dist.get_world_size())]
    if args.trace:
        dist.all_gather_object(traces, result.actions)
    if rank == 0:
        out = report(result, plan=plan, model_name=args.model, options=options, peak_mem_per_rank=peaks,
                     world_size=dist.get_world_size())
        if args.trace:
            from autoplan.execute.trace import timeline_report

            out["timeline"] = timeline_report(traces)
        text = json.dumps(out, indent=2) + "\n"
        if args.report:
            with open(args.report, "w") as f:
                f.write(text)
        print(f"autoplan run: losses {[f'{x:.6f}' for x in result.losses]}, step time "
              f"{out['step_time_s']:.4f} s (median after the first)", flush=True)
    dist.barrier()  # before destroy after DTensor work (TORCH_NOTES.md)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> NoReturn:
    args = parse_args(argv)
    run_guarded(args.run_dir, lambda rank: _run(args, rank))


def run_guarded(run_dir: str, body: Callable[[int], None]) -> NoReturn:
    """Run body(rank) with the launcher's failure protocol: the stack on SIGTERM to
    <run-dir>/stack-<rank>.txt, a failure's traceback to <run-dir>/error-<rank>.json, then exit 1
    (launch.diagnose reads both); a clean run exits 0, both without interpreter teardown
    (exit_without_teardown). Shared by the training worker, autoplan.execute.serve and
    autoplan.execute.component_worker."""
    rank = int(os.environ.get("RANK", "0"))
    os.makedirs(run_dir, exist_ok=True)
    # kept open for the life of the process: faulthandler writes to it on SIGTERM
    stack_file = open(os.path.join(run_dir, f"stack-{rank}.txt"), "w")  # noqa: SIM115
    faulthandler.register(signal.SIGTERM, file=stack_file, all_threads=True, chain=True)
    try:
        body(rank)
    except BaseException as exc:  # noqa: BLE001 - recorded for the launcher, then the rank exits 1
        record = {"rank": rank, "time": time.time(), "type": type(exc).__name__, "message": str(exc),
                  "traceback": traceback.format_exc()}
        path = os.path.join(run_dir, f"error-{rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)
        sys.stderr.write(f"[rank {rank}] {record['traceback']}")
        exit_without_teardown(1)  # a broken process group can hang the teardown
    stack_file.close()
    exit_without_teardown(0)


def exit_without_teardown(code: int) -> NoReturn:
    """Flush stdio and leave with os._exit: no interpreter teardown. A failed rank's broken process group can
    hang it; after a clean run gloo's worker threads can still hold work objects with Python references, and
    destroying them while the interpreter finalizes aborts the process ("terminate called without an active
    exception", SIGABRT; pytorch PR #179291 describes it): about one run in twenty here, after the report
    was written. For any process that had a gloo process group (the workers here, `autoplan profile` under
    torchrun); everything else it wrote is closed already."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
