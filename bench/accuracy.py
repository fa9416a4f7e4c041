"""One accuracy bench: every public check in one table, per set and per engine.

    python bench/accuracy.py [--rows] [--records PATH] [--plot docs/accuracy.png]

Targets (issue 8): vTrain multi-node and single-node (measured Megatron-DeepSpeed iterations,
bench/data/vtrain), the SC'21 calibration rows and Korthikanti et al.'s per-layer times
(bench/data/calibration). Checks, printed and never fitted to: the other published runs in
bench/data/published (SC'21 Tables 1-2, Llama 3 405B, torchtitan on A100, Megatron-Core r0.8.0 on H100,
MegaScale's Megatron-LM baseline on A100, NVIDIA's DGX Cloud Benchmarking BF16 rows of NeMo / Megatron-Core on
DGX H100: dgxc-h100), the same-scale ZeRO-3 vs PTD-P pairs and whether every run that ran
is predicted to fit. Records whose source leaves a setting unpublished may list "alternatives" (other
plausible values, from the record's own text or the engine's defaults / validation): each is priced and
printed beside the recorded error, never used by the summaries. Errors are step-time errors, predicted / measured - 1: negative means predicted too fast.
Runs from a clean clone (no files outside it). --plot PATH also writes a PNG of exactly the rows the table
summarises (bench/accuracy_plot.py: predicted vs measured, and the signed errors per set); matplotlib is
imported only then.

--records PATH prices another file of the same format in place of bench/data/published/published_runs.json:
{"records": [...]}, each record an object with "id" (unique), "set", "engine" (a shipped engine name),
"model" ("family" gpt with hidden, heads, layers, vocab, seq_len; llama adds kv_heads, ffn), "cluster"
("profile", "gpus", "dtype"), "config" (ParallelConfig fields), "global_batch" and "measured" (one of
iteration_time_s, tflops_per_gpu_with_recompute, tflops_per_gpu_megatron_core, mfu_megatron_core_flops,
tokens_per_s_per_gpu, mfu); optional: engine_overrides, stage_layout, every_other_layer_full, pair,
alternatives. Record "torchtitan-llama2-13b-bs2-none" of the shipped file is an example. A file that is not
JSON, or a record without one of those keys, stops the bench with one line (exit 2); a record the cost model
refuses (an engine that does not run its config, degrees that do not divide, a model field missing) is
printed as REFUSED with its reason, counted in its set's line, left out of every figure, and the bench
exits 1 after printing the rest.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's autoplan

import accuracy_plot
import validate_calibration
import validate_vtrain
from published import (
    RUNS,
    Alternative,
    Refused,
    Result,
    alternatives,
    check_alternative,
    price,
    recorded_values,
    records,
)

TARGETS = ("vtrain-multi", "vtrain-single", "calibration", "korthikanti-layer")


def vtrain_results(name: str, set_name: str) -> list[Result]:
    engine = validate_vtrain.vtrain_engine()
    out = []
    for row in validate_vtrain.read_rows(name):
        out.append(Result(set=set_name, label=validate_vtrain.describe(row), engine=engine.name,
                          predicted_s=validate_vtrain.predict_s(row, engine),
                          measured_s=row["iteration time (ms)"] / 1e3))
    return out


def summary(results: list[Result]) -> str:
    errors = [r.error for r in results]
    worst = max(results, key=lambda r: abs(r.error))
    return (f"{len(results):5d}  MAPE {100 * statistics.mean(abs(e) for e in errors):5.1f} %  median |e| "
            f"{100 * statistics.median(abs(e) for e in errors):5.1f} %  median signed "
            f"{100 * statistics.median(errors):+6.1f} %  worst {100 * worst.error:+6.1f} %")


def counted(rs: list[Result], refused: list[Refused]) -> str:
    """summary(rs), and where some of these runs were refused, how many of how many (none in the figures)."""
    text = summary(rs) if rs else f"{0:5d}  (none priced)"
    return text + (f"   {len(rs) + len(refused)} runs, {len(refused)} refused" if refused else "")


def print_table(results: list[Result], refused: list[Refused] = ()) -> None:
    by_set: dict[str, list[Result]] = defaultdict(list)
    for r in results:
        by_set[r.set].append(r)
    for r in refused:
        by_set.setdefault(r.set, [])
    print(f"{'set':22s} {'engine':18s}  {'runs':>5s}")
    for name, rs in by_set.items():
        kind = "target" if name in TARGETS else "check"
        print(f"{name:22s} {'(all)':18s} {counted(rs, [r for r in refused if r.set == name])}   [{kind}]")
        engines = sorted({r.engine for r in rs})
        for engine in engines if len(engines) > 1 else ():
            print(f"{'':22s} {engine:18s} {summary([r for r in rs if r.engine == engine])}")
    print()
    by_engine: dict[str, list[Result]] = defaultdict(list)
    for r in results:
        by_engine[r.engine].append(r)
    for r in refused:
        by_engine.setdefault(r.engine, [])
    print("per engine, over every set:")
    for engine, rs in sorted(by_engine.items()):
        print(f"  {engine:18s} {counted(rs, [r for r in refused if r.engine == engine])}")


def print_pairs(results: list[Result], recs: list[dict]) -> None:
    """Narayanan et al. SC'21 Table 2: ZeRO-3 (DeepSpeed, no model parallelism) against PTD-P at the same
    GPU count: the published speed-up of PTD-P and the predicted one (ratio of step times)."""
    by_id = {r.label: r for r in results}
    print("ZeRO-3 vs PTD-P at the same scale (SC'21 Table 2): PTD-P speed-up, published / predicted")
    right = skipped = 0
    pairs = sorted({rec["pair"] for rec in recs if rec.get("pair")}, key=lambda p: (p.split("-")[0], int(p.split("-")[1])))
    for pair in pairs:
        size, gpus = pair.split("-")
        z, p = by_id.get(f"sc21-t2-zero3-{size}-{gpus}"), by_id.get(f"sc21-t2-ptdp-{size}-{gpus}")
        if z is None or p is None:
            print(f"  {size} on {gpus:>4s} GPUs: not compared (a run of the pair was refused or is missing)")
            skipped += 1
            continue
        published, predicted = z.measured_s / p.measured_s, z.predicted_s / p.predicted_s
        right += (published > 1) == (predicted > 1)
        print(f"  {size} on {gpus:>4s} GPUs: x{published:.2f} published, x{predicted:.2f} predicted  (ZeRO-3 step "
              f"{z.predicted_s:.1f} s predicted / {z.measured_s:.1f} s measured; PTD-P {p.predicted_s:.1f} / "
              f"{p.measured_s:.1f} s)")
    print(f"  {right} of {len(pairs) - skipped} pairs in the published order")


def print_fits(results: list[Result], refused: list[Refused] = ()) -> None:
    misses = [r for r in results if not r.fits]
    print(f"runs that ran, predicted to fit: {sum(r.fits for r in results)} of {len(results)}"
          + (f" ({len(refused)} more refused, not priced)" if refused else ""))
    for r in misses:
        mem = r.estimate.memory
        print(f"  predicted NOT to fit: {r.label} ({r.estimate.peak_mem_bytes / 2**30:.1f} GiB: weights "
              f"{mem.weights / 2**30:.1f}, grads {mem.gradients / 2**30:.1f}, optimizer {mem.optimizer / 2**30:.1f}, "
              f"activations {mem.activations / 2**30:.1f}, reserve {mem.reserve / 2**30:.1f})")
    for r in results:
        if r.set == "llama3-405b":
            e = r.estimate
            print(f"  {r.label}: MFU {e.mfu:.3f} predicted, step {r.predicted_s:.2f} s vs {r.measured_s:.2f} s "
                  f"({100 * r.error:+.1f} %), peak {e.peak_mem_bytes / 2**30:.1f} GiB, fits {e.fits}")


def alternative_text(alt: Alternative) -> str:
    r = alt.result
    if isinstance(r, Refused):
        return f"{alt.name}: REFUSED ({r.reason})"
    return f"{alt.name}: {100 * r.error:+.1f} %" + ("" if r.fits else " (predicted NOT to fit)")


def print_alternatives(checks: list[Result], alts: dict[str, list[Alternative]], recs: list[dict]) -> None:
    """Each record with unpublished settings: its error as recorded and under each alternative the record
    names (bench/data/published "alternatives"): shown, never chosen; the summaries above use the recorded."""
    print("unpublished settings: error as recorded and under each alternative (shown, never chosen)")
    by_id = {rec["id"]: rec for rec in recs}
    for r in checks:
        if alts.get(r.label):
            rec_values = recorded_values(by_id[r.label])
            print(f"  {r.label}: {100 * r.error:+.1f} % as recorded ({rec_values}); "
                  + "; ".join(alternative_text(a) for a in alts[r.label]))


def check_all_alternatives(recs: list[dict]) -> None:
    for rec in recs:
        for alt in rec.get("alternatives", []):
            check_alternative(rec, alt)


def published_checks(recs: list[dict], refused: list[Refused] | None = None,
                     ) -> tuple[list[Result], dict[str, list[Alternative]]]:
    """One Result per record, priced with its recorded settings (what the summaries use), and apart from
    them each record's alternatives, by record id. A record that cannot be priced is left out, its Refused
    appended to `refused`."""
    priced = [price(rec) for rec in recs]
    (refused if refused is not None else []).extend(r for r in priced if isinstance(r, Refused))
    return ([r for r in priced if isinstance(r, Result)],
            {rec["id"]: alternatives(rec) for rec in recs if rec.get("alternatives")})


def print_refused(refused: list[Refused], alts: dict[str, list[Alternative]]) -> int:
    """Every record and alternative that could not be priced, one line each; 1 (the exit status) if any."""
    lines = [f"  REFUSED  {r.label}: {r.reason}" for r in refused]
    lines += [f"  REFUSED  {rid}: alternative {a.name!r}: {a.result.reason}"
              for rid, alist in alts.items() for a in alist if isinstance(a.result, Refused)]
    if lines:
        print(f"\nnot priced, left out of every figure above ({len(lines)}):", *lines, sep="\n")
    return 1 if lines else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags; a --plot path that cannot be written is refused here, before any pricing."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", action="store_true", help="every check row, not only the summaries")
    parser.add_argument("--records", type=Path, default=RUNS, help="a records file of the same format "
                        "(see the docstring), in place of bench/data/published/published_runs.json")
    parser.add_argument("--plot", metavar="PATH", help="also write a PNG of the rows the table summarises")
    args = parser.parse_args(argv)
    if args.plot is not None:
        path = Path(args.plot)
        if path.suffix.lower() != ".png":
            raise ValueError(f"--plot {args.plot}: the picture is a PNG; give a path ending in .png")
        if not path.parent.is_dir():
            raise ValueError(f"--plot {args.plot}: no directory {path.parent}; create it or pick another path")
    return args


def print_rows(checks: list[Result], alts: dict[str, list[Alternative]]) -> None:
    for r in checks:
        print(f"  {r.set:20s} {r.label:36s} {r.engine:13s} predicted {r.predicted_s:8.2f} s  measured "
              f"{r.measured_s:8.2f} s  {100 * r.error:+6.1f} %  fits {r.fits}")
        for a in alts.get(r.label, ()):
            if isinstance(a.result, Refused):
                print(f"  {'':20s}   alternative {a.name:33s} REFUSED: {a.result.reason}")
                continue
            print(f"  {'':20s}   alternative {a.name:33s} predicted {a.result.predicted_s:8.2f} s  measured "
                  f"{a.result.measured_s:8.2f} s  {100 * a.result.error:+6.1f} %  fits {a.result.fits}")


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        recs = records(args.records)
        check_all_alternatives(recs)  # a malformed file or alternative stops the bench before any pricing
    except ValueError as err:
        print(f"accuracy: error: {err}", file=sys.stderr)
        return 2
    results = (vtrain_results("ground_truth_multi.csv", "vtrain-multi")
               + vtrain_results("ground_truth_single.csv", "vtrain-single")
               + validate_calibration.calibration_results() + validate_calibration.korthikanti_results())
    refused: list[Refused] = []
    checks, alts = published_checks(recs, refused)
    summarised = results + checks  # the table's rows, and the plot's: never the alternatives
    print_table(summarised, refused)
    print()
    for r in validate_calibration.korthikanti_results():
        print(f"  Korthikanti per-layer {r.label:40s} {1e3 * r.predicted_s:6.2f} ms vs {1e3 * r.measured_s:5.1f} ms "
              f"({100 * r.error:+.1f} %)")
    print()
    print_pairs(checks, recs)
    print()
    print_fits(validate_calibration.calibration_results() + checks, refused)
    print()
    print_alternatives(checks, alts, recs)
    if args.rows:
        print()
        print_rows(checks, alts)
    if args.plot is not None:
        accuracy_plot.write_png(accuracy_plot.plot_series(summarised, TARGETS), args.plot)
        print(f"\nwrote {args.plot}")
    return print_refused(refused, alts)


if __name__ == "__main__":
    raise SystemExit(main())
