"""Planning time, end to end: `autoplan plan --model M --cluster C --nodes N --global-batch B --seq-len S` in a
fresh `python` process (the command's own entry point: it gets the layer graph, captured or read from the
on-disk cache, runs the search, prints the table and the explanation, and exits), timed from outside the
process (interpreter start-up, imports and exit included). Cold: an empty cache; warm: the same cache a
second time. The graph and search phases are timed inside by wrapping the two API calls the command makes.

Prints the reference jobs of issue 11 against their targets, planning time against the number of devices
(8 to 32,768) and against model size (1.7B to 1T, dense and MoE), each with the machine's load average, and
writes a PNG of the two sweeps. Timings depend on what else runs on the machine: compare at a quiet moment.

    python bench/plan_speed.py                  # everything (a few minutes)
    python bench/plan_speed.py --only reference # the four reference jobs
    python bench/plan_speed.py --only reference --repeat 3  # the fastest of 3 (each cold one with its own cache)
    python bench/plan_speed.py --png plan_speed.png
    python bench/plan_speed.py --replot plan_speed.json --png plan_speed.png
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# name -> (preset, cluster profile, nodes of 8, global batch, seq_len, cold target s, warm target s)
REFERENCE = {
    # Narayanan et al. SC'21, table 1: GPT-3 175B on 1,024 A100s, batch 1536, sequence 2048
    "gpt3-175b": ("gpt3-175b", "dgx-a100-80gb", 128, 1536, 2048, 3.0, 1.5),
    # the same paper's 1T model on 3,072 A100s, batch 3072
    "gpt3-1t": ("gpt3-1t", "dgx-a100-80gb", 384, 3072, 2048, 5.0, None),
    # Llama 3 (Dubey et al. 2024), section 3.3: 405B on 16,384 H100s, 16M tokens per step at 8K
    "llama3-405b": ("llama3-405b", "dgx-h100-80gb", 2048, 2048, 8192, 5.0, None),
    # DeepSeek-V3 technical report (2024), section 3-4: 2,048 H800s (here H100s), batch up to 15360 at 4K
    "deepseek-v3": ("deepseek-v3", "dgx-h100-80gb", 256, 15360, 4096, 15.0, None),
}
DEVICES = (8, 32, 128, 512, 2048, 8192, 32768)  # llama3-8b on H100, batch max(1024, devices), seq 4096
MODELS = ("gpt3-1.7b", "llama3-8b", "gpt3-18b", "llama3-70b", "gpt3-175b", "llama3-405b", "gpt3-530b", "gpt3-1t",
          "mixtral-8x7b", "deepseek-v3")  # on 1,024 H100s, batch 1024, seq 2048

# The child is `autoplan plan` as a user types it (autoplan.cli.main.entry: parse, plan, print the table and
# the explanation, exit), with the graph capture and the search timed from inside by wrapping the two API
# functions the command calls; the figure quoted is the process's wall time seen from outside. The wrappers
# go in when the command imports autoplan.search.api (a hook on that one import), not before: the command
# forks a cold preset's capture before it imports the search and numpy (graph/named.py), and so must this.
CHILD = r"""
import importlib.abc, importlib.util, json, resource, sys, time
t0 = time.perf_counter()
job = json.loads(sys.argv[1])
from autoplan.cli import main as cli
t1 = time.perf_counter()
seen = {"graph_s": 0.0}

class WrapApi(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name != "autoplan.search.api":
            return None
        sys.meta_path.remove(self)
        self.spec = importlib.util.find_spec(name)
        return importlib.util.spec_from_loader(name, self)
    def create_module(self, spec):
        return None
    def exec_module(self, module):
        self.spec.loader.exec_module(module)
        wrap(module)

def wrap(api):
    real_graph, real_plan = api.model_graph, api.autoplan
    def model_graph(*a, **k):
        start = time.perf_counter()
        graph = real_graph(*a, **k)
        seen["graph_s"] += time.perf_counter() - start
        seen["params"], seen["torch"] = graph.num_params, "torch" in sys.modules
        return graph
    def autoplan(*a, **k):
        start = time.perf_counter()
        plans = real_plan(*a, **k)
        seen["plan_s"], seen["best"] = time.perf_counter() - start, plans[0]
        return plans
    api.model_graph, api.autoplan = model_graph, autoplan

if "autoplan.search.api" in sys.modules:  # imported with the command line's modules: wrap it now
    wrap(sys.modules["autoplan.search.api"])
else:
    sys.meta_path.insert(0, WrapApi())
argv = ["plan", "--model", job["model"], "--cluster", job["cluster"], "--nodes", str(job["nodes"]),
        "--global-batch", str(job["global_batch"]), "--seq-len", str(job["seq_len"]), "--top-k", "5"]
sys.argv = ["autoplan", *argv]
real_exit = sys.exit
def report(code):
    own, workers = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    best = seen["best"]
    print(json.dumps({"import_s": t1 - t0, "graph_s": seen["graph_s"], "search_s": seen["plan_s"] - seen["graph_s"],
                      "torch": seen["torch"], "cpu_s": own.ru_utime + own.ru_stime,
                      "workers_cpu_s": workers.ru_utime + workers.ru_stime, "params": seen["params"],
                      "best": str(best.config), "step_s": best.estimate.step_time_s}))
    real_exit(code)
sys.exit = report
cli.entry()
"""


def compile_bytecode() -> None:
    """autoplan's modules compiled to __pycache__ first, as an installed autoplan has them (pip compiles a wheel
    at install; an editable checkout writes them on first import): where PYTHONDONTWRITEBYTECODE is set, as on
    some CI machines, every fresh process would otherwise compile the ~120 modules a plan imports again
    (about 0.1 s here). The graph cache is what "cold" empties, not Python's bytecode."""
    import compileall

    compileall.compile_dir(str(ROOT / "autoplan"), quiet=1)


def plan_once(job: dict, cache: str) -> dict:
    """One fresh process planning `job` with graph cache `cache`; its phases and the wall time seen from here."""
    import time

    env = {**os.environ, "AUTOPLAN_CACHE_DIR": cache, "PYTHONPATH": str(ROOT)}
    load = os.getloadavg()[0]
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(job)], capture_output=True, text=True, env=env,
                         check=False)
    wall = time.perf_counter() - start
    if out.returncode:
        raise SystemExit(f"plan_speed: planning {job} failed:\n{out.stderr[-2000:]}")
    return {**json.loads(out.stdout.strip().splitlines()[-1]), "wall_s": wall, "load": load}


REPEAT = 1  # --repeat: each figure is the fastest of this many runs (a busy machine only ever adds time)


def cold_and_warm(job: dict) -> tuple[dict, dict]:
    """The fastest cold plan (an empty cache each time) and the fastest warm plan of REPEAT tries."""
    runs = []
    for _ in range(REPEAT):
        with tempfile.TemporaryDirectory(prefix="autoplan-bench-cache-") as cache:
            runs.append((plan_once(job, cache), plan_once(job, cache)))
    return min((c for c, _ in runs), key=lambda r: r["wall_s"]), min((w for _, w in runs), key=lambda r: r["wall_s"])


def _job(model: str, cluster: str, nodes: int, batch: int, seq: int) -> dict:
    return {"model": model, "cluster": cluster, "nodes": nodes, "global_batch": batch, "seq_len": seq}


def _row(label: str, cold: dict, warm: dict) -> str:
    """Wall times, and the CPU seconds of the planning process + its search workers: on an idle machine the
    wall time is about the process's own CPU time (the workers run beside it), on a loaded one much more."""
    return (f"{label:34s} cold {cold['wall_s']:6.2f} s (graph {cold['graph_s']:5.2f}, cpu {cold['cpu_s']:5.2f} + "
            f"{cold['workers_cpu_s']:4.2f})  warm {warm['wall_s']:5.2f} s (search {warm['search_s']:5.2f}, cpu "
            f"{warm['cpu_s']:4.2f} + {warm['workers_cpu_s']:4.2f}, torch {'yes' if warm['torch'] else 'no'})  "
            f"load {cold['load']:.1f}/{warm['load']:.1f}")


def reference() -> None:
    print("reference jobs (end to end, fresh process; targets from issue 11 on an idle 2-core machine):")
    for name, (model, cluster, nodes, batch, seq, cold_target, warm_target) in REFERENCE.items():
        cold, warm = cold_and_warm(_job(model, cluster, nodes, batch, seq))
        targets = f"target cold <= {cold_target:.1f} s" + (f", warm <= {warm_target:.1f} s" if warm_target else "")
        print(_row(f"{name} on {nodes * 8:,} GPUs", cold, warm) + f"  [{targets}]")
        print(f"{'':34s} best: {warm['best']}, {warm['step_s']:.2f} s per step")


def sweep(points: list[tuple[str, dict]], title: str) -> list[tuple[str, dict, dict, dict]]:
    print(title)
    out = []
    for label, job in points:
        cold, warm = cold_and_warm(job)
        print(_row(label, cold, warm))
        out.append((label, job, cold, warm))
    return out


def plot(devices: list, models: list, path: str) -> None:
    """Wall time (solid) and the planning process's own CPU time (dashed: about the wall time on an idle
    machine) against devices and against parameters, dense and MoE models apart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    moe = {"mixtral-8x7b", "deepseek-v3"}
    panels = ((left, [("", devices)], lambda job, c: job["nodes"] * 8, "devices (llama3-8b, H100)"),
              (right, [("dense ", [r for r in models if r[0] not in moe]), ("MoE ", [r for r in models if r[0] in moe])],
               lambda job, c: c["params"] / 1e9, "parameters, billions (1,024 H100s)"))
    for axis, series, x_of, xlabel in panels:
        for prefix, rows in series:
            xs = [x_of(job, cold) for _, job, cold, _ in rows]
            marker = "o" if prefix != "MoE " else "D"
            for which, color in (("cold", "tab:blue"), ("warm", "tab:orange")):
                pick = (lambda r: r[2]) if which == "cold" else (lambda r: r[3])
                axis.plot(xs, [pick(r)["wall_s"] for r in rows], marker=marker, color=color, linestyle="-",
                          label=f"{prefix}{which} wall")
                axis.plot(xs, [pick(r)["cpu_s"] for r in rows], marker=marker, color=color, linestyle="--",
                          alpha=0.6, label=f"{prefix}{which} process CPU")
            if axis is right:
                for (label, _, _, warm), x in zip(rows, xs):
                    axis.annotate(label, (x, warm["wall_s"]), fontsize=7, rotation=30)
        axis.set_xscale("log")
        axis.set_xlabel(xlabel)
        axis.set_ylabel("end-to-end planning time, s")
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=7)
    load = max(r[2]["load"] for r in devices + models)
    fig.suptitle(f"autoplan planning time, fresh process per plan (2 cores; load average up to {load:.1f})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("reference", "devices", "models"))
    parser.add_argument("--png", default="plan_speed.png", help="the plot; the figures go to the same name .json")
    parser.add_argument("--replot", metavar="JSON", help="plot the figures of an earlier run, measure nothing")
    parser.add_argument("--repeat", type=int, default=1, help="report the fastest of N runs of each plan")
    args = parser.parse_args()
    global REPEAT
    REPEAT = max(1, args.repeat)
    if args.replot:
        data = json.loads(Path(args.replot).read_text())
        plot(data["devices"], data["models"], args.png)
        return
    compile_bytecode()
    print(f"{os.cpu_count()} cores; load average now {os.getloadavg()[0]:.1f} (1 min)"
          + (f"; each figure the fastest of {REPEAT} runs" if REPEAT > 1 else ""))
    if args.only in (None, "reference"):
        reference()
    devices = models = []
    if args.only in (None, "devices"):
        devices = sweep([(f"llama3-8b on {n:,} GPUs", _job("llama3-8b", "dgx-h100-80gb", max(n // 8, 1), max(1024, n),
                                                             4096)) for n in DEVICES], "against devices:")
    if args.only in (None, "models"):
        models = sweep([(m, _job(m, "dgx-h100-80gb", 128, 1024, 2048)) for m in MODELS], "against model size:")
    if devices and models:
        Path(args.png).with_suffix(".json").write_text(json.dumps({"devices": devices, "models": models}, indent=1))
        plot(devices, models, args.png)


if __name__ == "__main__":
    main()
