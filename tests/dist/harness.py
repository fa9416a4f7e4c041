"""Run a function on N gloo ranks forked from the test process, with a FileStore and hard deadlines.

`run_ranks(fn, world_size, *args)` returns every rank's return value, or raises AssertionError with each
failing rank's own traceback (earliest failure first) and the ranks that never finished, so a failure
neither hangs nor hides behind another rank's "Connection closed by peer".
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.tensor
import torch.multiprocessing as mp

GRACE_S = 3.0  # after the first rank fails, how long the others get to report their own error


def _entry(rank: int, fn: Callable[..., Any], world_size: int, tmp: str, pg_timeout_s: float,
           args: tuple, kwargs: dict) -> None:
    torch.set_num_threads(1)  # N ranks share 2 cores; more threads only oversubscribe
    code = 0
    try:
        store = dist.FileStore(os.path.join(tmp, "store"), world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=pg_timeout_s))
        result = fn(rank, world_size, *args, **kwargs)
        torch.save(result, os.path.join(tmp, f"result-{rank}.pt"))
        dist.barrier()  # before destroy after DTensor work (TORCH_NOTES.md)
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - everything is reported to the parent
        with open(os.path.join(tmp, f"error-{rank}.txt"), "w") as f:
            f.write(f"{time.time():.6f}\n{traceback.format_exc()}")
        code = 1
    os._exit(code)  # skip interpreter teardown: gloo threads of a failed group can hang it


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, deadline_s: float = 240.0,
              pg_timeout_s: float = 60.0, **kwargs: Any) -> list[Any]:
    """fn(rank, world_size, *args, **kwargs) on each rank, inside an initialised gloo process group."""
    tmp = tempfile.mkdtemp(prefix="autoplan-dist-")
    try:
        context = mp.start_processes(_entry, args=(fn, world_size, tmp, pg_timeout_s, args, kwargs),
                                     nprocs=world_size, join=False, start_method="fork")
        hung = _wait(context.processes, deadline_s)
        return _collect(tmp, world_size, hung, deadline_s)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _wait(processes: list, deadline_s: float) -> list[int]:
    """Wait for all ranks; after the first failure or the deadline, kill the rest. Returns the killed."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        codes = [p.exitcode for p in processes]
        if all(c is not None for c in codes):
            return []
        if any(c not in (None, 0) for c in codes):
            end = min(end, time.monotonic() + GRACE_S)
        time.sleep(0.02)
    killed = [rank for rank, p in enumerate(processes) if p.exitcode is None]
    for rank in killed:
        processes[rank].kill()
    for p in processes:
        p.join()
    return killed


def _collect(tmp: str, world_size: int, killed: list[int], deadline_s: float) -> list[Any]:
    errors = []
    for rank in range(world_size):
        path = os.path.join(tmp, f"error-{rank}.txt")
        if os.path.exists(path):
            with open(path) as f:
                stamp, text = f.read().split("\n", 1)
            errors.append((float(stamp), rank, text))
    if errors or killed:
        parts = [f"--- rank {rank} failed:\n{text}" for _, rank, text in sorted(errors)]
        if killed:
            parts.append(f"--- ranks {killed} did not finish (killed after the first failure or the "
                         f"{deadline_s:.0f} s deadline)")
        raise AssertionError("distributed run failed\n" + "\n".join(parts))
    return [torch.load(os.path.join(tmp, f"result-{r}.pt"), weights_only=False) for r in range(world_size)]


# --- the single-process reference and a plan's run, for the executor tests -------------------------

def _reference(rank: int, world_size: int, model_name: str, steps: int, seed: int, global_batch: int,
               seq_len: int, lr: float, weight_decay: float) -> dict[str, Any]:
    """The plain single-device loop every plan must reproduce: no autoplan.execute machinery but the
    contract's data (make_batch)."""
    import torch.nn.functional as F

    from autoplan.execute.train import make_batch
    from autoplan.models import preset

    torch.manual_seed(seed)
    model = preset(model_name)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, foreach=False)
    losses, norms = [], []
    for step in range(steps):
        batch = make_batch(seed, step, global_batch=global_batch, seq_len=seq_len,
                           vocab_size=model.config.vocab_size)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))
        loss.backward()
        norms.append(float(torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters()))))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grad_norms": norms,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


_REFERENCES: dict[tuple, dict[str, Any]] = {}


def reference(model_name: str, *, steps: int, seed: int = 0, global_batch: int = 8, seq_len: int = 16,
              lr: float = 1e-3, weight_decay: float = 0.01) -> dict[str, Any]:
    """Losses and final parameters of the reference, computed once per argument set (in a forked
    process, so this test process never starts thread pools before forking ranks)."""
    key = (model_name, steps, seed, global_batch, seq_len, lr, weight_decay)
    if key not in _REFERENCES:
        _REFERENCES[key] = run_ranks(_reference, 1, *key)[0]
    return _REFERENCES[key]


def _train_rank(rank: int, world_size: int, model_name: str, plan: Any, options: Any) -> dict[str, Any]:
    from autoplan.execute.train import full_parameters, train

    result = train(model_name, plan, options, device=torch.device("cpu"))
    return {"losses": result.losses, "grad_norms": result.grad_norms, "params": full_parameters(result.parts)}


def run_plan(model_name: str, plan: Any, *, steps: int, seed: int = 0, global_batch: int = 8,
             seq_len: int = 16, deadline_s: float = 240.0) -> dict[str, Any]:
    """Train `plan` on its number of ranks; rank 0's losses and every parameter (merged over ranks)."""
    from autoplan.execute.apply import config_of
    from autoplan.execute.train import TrainOptions

    options = TrainOptions(steps=steps, seed=seed, global_batch=global_batch, seq_len=seq_len)
    results = run_ranks(_train_rank, config_of(plan).num_devices, model_name, plan, options,
                        deadline_s=deadline_s)
    params: dict[str, torch.Tensor] = {}
    for result in results:
        params.update(result["params"])
    for result in results[1:]:
        assert result["losses"] == results[0]["losses"], "ranks disagree on the global loss"
    for result in results[1:]:
        assert result["grad_norms"] == pytest.approx(results[0]["grad_norms"], rel=1e-9), "ranks disagree on the norm"
    return {"losses": results[0]["losses"], "grad_norms": results[0]["grad_norms"], "params": params}


def assert_matches_reference(run: dict[str, Any], ref: dict[str, Any], *, loss_tol: float = 1e-5,
                             param_tol: float = 1e-4) -> None:
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]),
                               rtol=loss_tol, atol=loss_tol)
    if "grad_norms" in run and "grad_norms" in ref:  # the gradients' scale, which AdamW's update hides
        torch.testing.assert_close(torch.tensor(run["grad_norms"]), torch.tensor(ref["grad_norms"]),
                                   rtol=1e-4, atol=1e-7, msg=lambda m: f"global gradient norm per step: {m}")
    assert sorted(run["params"]) == sorted(ref["params"]), "parameter names differ from the reference"
    for name, value in ref["params"].items():
        torch.testing.assert_close(run["params"][name], value, rtol=param_tol, atol=param_tol,
                                   msg=lambda m, n=name: f"{n}: {m}")


@contextlib.contextmanager
def plan_collectives(step: list[int], names: tuple[str, ...],
                     record: Callable[[str, tuple, dict], None]) -> Iterator[None]:
    """While the block runs, hand record(name, args, kwargs) every call of torch.distributed's `names` that
    step[0] == 1 makes over a process group (the loss's all-reduce has none), before it runs, but those of
    the step's gradient-norm check (execute.train.global_grad_norm: execute.gradnorm), which are not the
    plan's ZeRO traffic; the originals are put back after."""
    import autoplan.execute.train as train_module

    originals = {n: getattr(dist, n) for n in names}
    in_norm = [False]

    def recording(name: str) -> Callable[..., Any]:
        def call(*args, **kwargs):
            if step[0] == 1 and kwargs.get("group") is not None and not in_norm[0]:
                record(name, args, kwargs)
            return originals[name](*args, **kwargs)
        return call

    norm_fn = train_module.global_grad_norm

    def norm_unrecorded(*args, **kwargs):
        in_norm[0] = True
        try:
            return norm_fn(*args, **kwargs)
        finally:
            in_norm[0] = False

    for name in names:
        setattr(dist, name, recording(name))
    train_module.global_grad_norm = norm_unrecorded
    try:
        yield
    finally:
        train_module.global_grad_norm = norm_fn
        for name, fn in originals.items():
            setattr(dist, name, fn)
