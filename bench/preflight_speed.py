"""How long `autoplan run` takes to refuse each mistake the checks before launch catch, from a cold start (a fresh
`python -m autoplan.cli.main run ...` each time, so the interpreter and the torch import are included), with the
exit code and the one line it printed. Wall time is noisy on a shared machine: CPU time (user + sys of the
process) is printed beside it.

    python bench/preflight_speed.py
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

JOB = ["--global-batch", "8", "--seq-len", "16", "--steps", "2"]


def _plans(tmp: Path) -> dict[str, str]:
    """Plan files for the plan mistakes: one for tiny-gpt, and one hand-edited to tp=4 with num_devices 8."""
    sys.path.insert(0, str(Path(__file__).parents[1]))
    from autoplan.execute.source import meta_device
    from autoplan.graph.fingerprint import model_fingerprint
    from autoplan.models import preset
    from autoplan.plan.io import save_plan
    from autoplan.plan.types import Breakdown, Estimate, ParallelConfig, Plan

    with meta_device():
        fingerprint = model_fingerprint(preset("tiny-gpt"))
    estimate = Estimate(step_time_s=0.1, tokens_per_s=1.0, mfu=0.1, peak_mem_bytes=2**28, mem_capacity_bytes=2**34,
                        fits=True, breakdown=Breakdown())
    out = {}
    for name, config, devices in (("tiny-gpt", ParallelConfig(dp=2), 2), ("edited", ParallelConfig(tp=4, dp=8), 8)):
        plan = Plan(config=config, estimate=estimate, model_name="tiny-gpt", cluster_name="local-cpu",
                    num_devices=devices, global_batch=8, seq_len=16, fingerprint=fingerprint)
        out[name] = str(tmp / f"{name}.json")
        save_plan(plan, out[name])
    return out


def _mistakes(tmp: Path) -> dict[str, list[str]]:
    plans = _plans(tmp)
    return {
        "plan made for another model": ["--plan", plans["tiny-gpt"], "--model", "tiny-llama", "--steps", "2"],
        "tp=4 x dp=8 plan with num_devices 8": ["--plan", plans["edited"], "--model", "tiny-gpt", "--steps", "2"],
        "rank count": ["--model", "tiny-gpt", *JOB, "--dp", "4", "--nproc-per-node", "2"],
        "--steps 0": ["--model", "tiny-gpt", *JOB[:4], "--steps", "0"],
        "--save-every without --checkpoint-dir": ["--model", "tiny-gpt", *JOB, "--save-every", "1"],
        "--resume of a missing directory": ["--model", "tiny-gpt", *JOB, "--resume", str(tmp / "nowhere")],
        "stage layout (more stages than blocks)": ["--model", "tiny-gpt", *JOB, "--pp", "8", "--nproc-per-node", "8"],
        "token ids beyond the vocabulary": ["--model", "tiny-gpt", *JOB, "--data", str(tmp / "tokens.npy")],
        "tp=3 does not divide the model": ["--model", "tiny-gpt", *JOB, "--tp", "3", "--nproc-per-node", "3"],
        "llama3-8b on this host": ["--model", "llama3-8b", *JOB],
    }


def measure(argv: list[str]) -> tuple[float, float, int, str]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "autoplan.cli.main", "run", *argv], capture_output=True, text=True,
                          timeout=120, check=False, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.returncode, done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""


def main() -> None:
    import numpy as np

    with tempfile.TemporaryDirectory() as tmp:
        np.save(Path(tmp) / "tokens.npy", np.arange(1000, dtype=np.int32))
        print(f"{'mistake':<42} {'wall s':>7} {'cpu s':>6} {'exit':>4}  line")
        for name, argv in _mistakes(Path(tmp)).items():
            wall, cpu, code, line = measure(argv)
            print(f"{name:<42} {wall:7.2f} {cpu:6.2f} {code:4d}  {line[:150]}")


if __name__ == "__main__":
    main()
