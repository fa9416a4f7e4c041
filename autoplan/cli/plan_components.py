"""`autoplan plan` for a model with components (a vision tower + projector + language model, a policy with
a sensor branch): autoplan.plan_components gives each component's device group its own strategy. The
search flags of `autoplan plan` apply to every group; --group-devices fixes the devices per group,
--handoff-microbatches the microbatches handed from group to group, --chain plans the model as one chain
(autoplan()) instead. --json writes the best ComponentPlan at the top level (what `autoplan run --plan`
reads) and every ranked plan under "ranked".
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def add_component_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("models with components (vision tower + projector + language model, ...)")
    g.add_argument("--chain", action="store_true", help="plan a model with components as one chain (autoplan())")
    g.add_argument("--group-devices", dest="group_devices", default=None, metavar="N,N[,N]",
                   help="devices of each device group, in the components' forward order (default: every split)")
    g.add_argument("--handoff-microbatches", dest="handoff_microbatches", default=None, metavar="M[,M]",
                   help="microbatches handed from group to group per step (default: every divisor of the batch)")


def has_components(model: str) -> bool:
    """A preset of autoplan.models.multimodal, or a file.py:factory / Hugging Face directory whose module tree
    holds two families of repeated blocks (graph.components.find_roots); decoder presets never do. Told
    without importing torch for a preset (autoplan.models.specs), which a warm plan then never imports."""
    from autoplan.models.specs import MULTIMODAL_NAMES, is_file_spec, is_hf_dir

    if model in MULTIMODAL_NAMES:
        return True
    if not (is_file_spec(model) or is_hf_dir(model)):  # a preset's name
        return False
    from autoplan.graph.components import find_roots
    from autoplan.search.api import load_model

    return bool(find_roots(load_model(model)))


def plans_components(args: argparse.Namespace) -> bool:
    """Whether `autoplan plan` plans components; the group flags on a chain are one line."""
    grouped = args.group_devices is not None or args.handoff_microbatches is not None
    if args.chain:
        if grouped:
            raise ValueError("--group-devices / --handoff-microbatches plan device groups: drop --chain")
        return False
    if has_components(args.model):
        return True
    if grouped:
        raise ValueError(f"--group-devices / --handoff-microbatches need a model with components (tiny-llava, "
                         f"llava-1.5-7b, tiny-policy); {args.model} is one chain")
    return False


def _ints(flag: str, text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} takes a comma list of integers, got {text!r}") from None


def cmd_plan_components(args: argparse.Namespace, options: dict[str, Any], cluster: Any) -> int:
    from autoplan.cli.plan import _print
    from autoplan.plan.components import component_plan_to_dict
    from autoplan.search.api import plan_components

    for flag, given in (("--csv", args.csv), ("--pareto", args.pareto), ("--export", args.export)):
        if given:
            raise ValueError(f"{flag} writes chain plans; {args.model} is planned in device groups: use --json "
                             f"(or --chain to plan it as one chain)")
    devices = _ints("--group-devices", args.group_devices)
    microbatches = _ints("--handoff-microbatches", args.handoff_microbatches)
    search = {k: v for k, v in options.items() if k not in ("global_batch", "top_k", "progress")}
    plans = plan_components(args.model, cluster, global_batch=options["global_batch"], seq_len=args.seq_len,
                            top_k=options.get("top_k", 3), devices=devices, num_microbatches=microbatches, **search)
    _print(plans.table())
    print(plans[0].explain())
    if args.json:
        data = {**component_plan_to_dict(plans[0]), "ranked": [component_plan_to_dict(p) for p in plans]}
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
        print(f"{len(plans)} ranked component plans written to {args.json} (the best at the top level: "
              f"autoplan run --plan {args.json} --model {args.model} --steps N runs it)")
    return 0
