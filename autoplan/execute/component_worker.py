"""Launch a ComponentPlan on torchrun ranks: `execute_components(plan, model, steps=...)` (also
`autoplan.execute_components`) and the per-rank entry `python -m autoplan.execute.component_worker`.

Failures are reported as `autoplan.execute` reports them (execute/launch.py: the first rank that failed
on its own, with its traceback). The model is a name of autoplan.models.multimodal.MULTIMODAL_PRESETS
("tiny-llava", "tiny-policy") or "path/to/file.py:factory", built on CPU after torch.manual_seed(seed)
on every rank.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

from autoplan.plan.components import ComponentPlan, load_component_plan, save_component_plan


def build_model(spec: str, seed: int) -> Any:
    """The full model on CPU from the seed (the same weights under every plan)."""
    import torch

    from autoplan.models.multimodal import MULTIMODAL_PRESETS

    torch.manual_seed(seed)
    if ":" in spec and spec.split(":", 1)[0].endswith(".py"):
        path, factory = spec.rsplit(":", 1)
        module_spec = importlib.util.spec_from_file_location(Path(path).stem, path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)  # type: ignore[union-attr]
        return getattr(module, factory)()
    if spec not in MULTIMODAL_PRESETS:
        raise ValueError(f"unknown model {spec!r} for a component run: choose one of {sorted(MULTIMODAL_PRESETS)} "
                         f"or give file.py:factory")
    return MULTIMODAL_PRESETS[spec]()


def execute_components(plan: ComponentPlan | str | Path, model: str, *, steps: int, seed: int = 0,
                       report: str | Path | None = None, timeout_s: float = 300.0, env: dict | None = None) -> dict:
    """Train `model` under a ComponentPlan (or its JSON path) on plan.num_devices local torchrun ranks;
    returns the report (losses, step times, the prediction). Raises ValueError before launching for a plan
    this executor does not run or a model it was not made for (execute.component_preflight), RunFailed
    when a rank fails."""
    from autoplan.execute.component_preflight import component_preflight
    from autoplan.execute.launch import run_torchrun, torchrun_command

    plan = plan if isinstance(plan, ComponentPlan) else load_component_plan(plan)
    component_preflight(plan, model, steps=steps)
    with tempfile.TemporaryDirectory(prefix="autoplan-components-") as run_dir:
        plan_path, report_path = os.path.join(run_dir, "plan.json"), str(report or os.path.join(run_dir, "r.json"))
        save_component_plan(plan, plan_path)
        args = ["--plan", plan_path, "--model", model, "--steps", str(steps), "--seed", str(seed),
                "--report", report_path, "--run-dir", run_dir, "--timeout-s", str(timeout_s)]
        cmd = torchrun_command(args, nproc_per_node=plan.num_devices, module="autoplan.execute.component_worker")
        run_torchrun(cmd, run_dir=run_dir, env=env)
        return json.loads(Path(report_path).read_text())


def _run(args: argparse.Namespace, rank: int) -> None:
    import torch
    import torch.distributed as dist

    from autoplan.execute.component_train import ComponentTrainOptions, train_components

    plan = load_component_plan(args.plan)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout_s))
    result = train_components(build_model(args.model, args.seed), plan, ComponentTrainOptions(
        steps=args.steps, seed=args.seed), device=torch.device("cpu"))
    if rank == 0:
        steady = result["step_times_s"][1:] or result["step_times_s"]
        out = {"model": args.model, "world_size": dist.get_world_size(), "seed": args.seed,
               "groups": [{"components": list(g.components), "ranks": list(g.ranks), "config": g.plan.config.to_dict()}
                          for g in plan.groups],
               "num_microbatches": plan.num_microbatches, "global_batch": plan.global_batch,
               "losses": result["losses"], "step_times_s": result["step_times_s"],
               "step_time_s": statistics.median(steady), "predicted_step_time_s": plan.estimate.step_time_s}
        Path(args.report).write_text(json.dumps(out, indent=2) + "\n")
        print(f"autoplan components: losses {[f'{x:.6f}' for x in result['losses']]}, step time "
              f"{out['step_time_s']:.4f} s (median after the first; predicted {plan.estimate.step_time_s:.4f} s)",
              flush=True)
    dist.barrier()  # before destroy after DTensor work (TORCH_NOTES.md)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> NoReturn:
    from autoplan.execute.worker import run_guarded

    p = argparse.ArgumentParser(prog="autoplan.execute.component_worker")
    for flag in ("--plan", "--model", "--report", "--run-dir"):
        p.add_argument(flag, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=300.0)
    args = p.parse_args(argv)
    run_guarded(args.run_dir, lambda rank: _run(args, rank))  # the launcher's failure protocol (launch.diagnose)


if __name__ == "__main__":
    main()
