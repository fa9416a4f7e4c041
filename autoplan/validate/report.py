"""The validation as text: a table of the plans (predicted and measured step time and peak memory) and
the summary lines, for the terminal and for the README (markdown)."""

from __future__ import annotations

from typing import Any

MIB = 2**20


def _ratio(e: dict[str, Any]) -> str:
    if not e.get("measured_step_time_s"):
        return "-"
    return f"{e['measured_step_time_s'] / e['predicted_step_time_s']:.2f}"


def rows(result: dict[str, Any]) -> list[list[str]]:
    """One row per plan, fastest predicted first: plan, predicted s, measured s, measured/predicted,
    predicted MiB, measured MiB (or the error), and the cores other processes used during the run."""
    out = []
    for e in sorted(result["plans"], key=lambda e: e["predicted_step_time_s"]):
        meas = e.get("measured_step_time_s")
        mem = e.get("measured_peak_mem_bytes")
        others = e.get("other_cpu_cores")
        out.append([e["label"], f"{e['predicted_step_time_s']:.4f}", f"{meas:.4f}" if meas else "FAILED",
                    _ratio(e), f"{e['predicted_peak_mem_bytes'] / MIB:.0f}", f"{mem / MIB:.0f}" if mem else "-",
                    "-" if others is None else f"{others:.2f}"])
    return out


HEADER = ["plan", "predicted s", "measured s", "measured / predicted", "predicted peak MiB", "measured peak MiB",
          "other processes' cores"]


def table(result: dict[str, Any]) -> Any:
    from rich.table import Table

    t = Table(title=f"{result['model']} on {result['nproc_per_node']} x {result['cluster']}, global batch "
                    f"{result['global_batch']} x {result['seq_len']} tokens, {result['steps']} steps")
    for i, name in enumerate(HEADER):
        t.add_column(name, justify="left" if i == 0 else "right")
    for row in rows(result):
        t.add_row(*row)
    return t


def summary_lines(result: dict[str, Any]) -> list[str]:
    def fmt(key: str, spec: str) -> str:
        value = result.get(key)
        return "-" if value is None else format(value, spec)

    lines = [(f"Spearman rank correlation {fmt('spearman', '.3f')} over {result['num_measured']} plans; "
             f"MAPE {fmt('mape', '.1%')}"),
             (f"predicted best: {result.get('predicted_best', '-')}; measured best: "
             f"{result.get('measured_best', '-')}; the predicted best measures {fmt('best_gap', '.1%')} "
             f"slower than the measured best")]
    failed = [e for e in result["plans"] if e.get("error")]
    lines += [f"FAILED {e['label']}: {e['error']}" for e in failed]
    return lines


def markdown(result: dict[str, Any]) -> str:
    """The table and summary as markdown (for the README)."""
    out = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    out += ["| " + " | ".join(r) + " |" for r in rows(result)]
    return "\n".join(out + [""] + summary_lines(result)) + "\n"
