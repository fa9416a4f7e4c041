"""`autoplan calibrate`: fit a profile's efficiency and overhead fields to measured runs (the JSON of
`autoplan validate`), cross-validated on runs the fit did not see, and write the fitted profile.

    autoplan validate --model tiny-gpt --cluster local-cpu --nproc-per-node 8 --plans 12 --json v8.json
    autoplan calibrate v8.json v4.json --cluster local-cpu --out my-cpu.yaml
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    from autoplan.cluster.calibrate import DEFAULT_FIELDS

    p = subparsers.add_parser("calibrate", help="fit a profile's efficiencies and overheads to measured runs")
    p.add_argument("runs", nargs="+", metavar="RUNS.json", help="`autoplan validate --json` files")
    p.add_argument("--cluster", default=None, help="profile to start from (default: the one the runs used)")
    p.add_argument("--out", required=True, metavar="FILE.yaml", help="fitted profile to write")
    p.add_argument("--fields", default=None, help="comma-separated profile fields to fit (default: "
                                                  + ", ".join(DEFAULT_FIELDS) + ")")
    p.add_argument("--held-out", dest="held_out", type=float, default=0.3,
                   help="fraction of the runs the fit does not see, to measure its error on (default 0.3)")
    p.add_argument("--seed", type=int, default=0, help="which runs are held out")
    p.add_argument("--name", default=None, help="name of the written profile (default: the --out file's stem)")
    p.set_defaults(func=cmd_calibrate)


def _start_profile(args: argparse.Namespace) -> Path:
    from autoplan.cluster.load import Cluster

    if args.cluster:
        return Cluster.path(args.cluster)
    used = {json.loads(Path(r).read_text()).get("profile") for r in args.runs}
    if len(used) != 1 or not next(iter(used)):
        raise ValueError(f"the runs were predicted on different profiles ({sorted(map(str, used))}): pass --cluster")
    return Cluster.path(next(iter(used)))


def cmd_calibrate(args: argparse.Namespace) -> int:
    import yaml

    from autoplan.cluster.calibrate import (
        DEFAULT_FIELDS,
        calibrate,
        fitted_profile_text,
        get_field,
        load_runs,
    )

    if not args.out.endswith((".yaml", ".yml")):
        raise ValueError(f"--out writes a YAML profile: give a name ending in .yaml, got {args.out!r}")
    fields = tuple(f.strip() for f in args.fields.split(",")) if args.fields else DEFAULT_FIELDS
    runs = load_runs(args.runs)
    path = _start_profile(args)
    text = path.read_text()
    profile = yaml.safe_load(text)
    for field in fields:
        get_field(profile, field)  # an unknown field fails here, before the fit
    print(f"fitting {', '.join(fields)} of {path.name} to {len(runs)} measured runs "
          f"({round(len(runs) * args.held_out)} held out) ...", flush=True)
    fit = calibrate(runs, profile, str(path), fields=fields, held_out_fraction=args.held_out, seed=args.seed)
    for field in fields:
        print(f"  {field}: {get_field(profile, field):.4g} -> {fit.values[field]:.4g}")
    b, a = fit.mape_before, fit.mape_after
    print(f"MAPE on the {len(fit.train)} training runs: {b['train']:.1%} -> {a['train']:.1%}; on the "
          f"{len(fit.held_out)} held-out runs: {b['held_out']:.1%} -> {a['held_out']:.1%}")
    names = ", ".join(sorted({r.source for r in runs}))
    note = (f"`autoplan calibrate` {datetime.date.today().isoformat()} fitted {', '.join(fields)} to "
            f"{len(fit.train)} of the {len(runs)} measured runs in {names}; MAPE on those {a['train']:.1%}, "
            f"on the {len(fit.held_out)} held out {a['held_out']:.1%} (before: {b['train']:.1%}, "
            f"{b['held_out']:.1%})")
    out = Path(args.out)
    out.write_text(fitted_profile_text(text, fit, note=note, name=args.name or out.stem))
    print(f"wrote {out}")
    return 0
