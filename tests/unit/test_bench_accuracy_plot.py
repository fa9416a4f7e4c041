"""bench/accuracy.py --plot: the series drawn from hand-made Results (sets, order, points, sorted errors,
medians, counts worked out by hand), that the bench hands the plot exactly the rows its table summarises
(never the alternatives), and the PNG it writes (a PNG of the stated size, no software metadata)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import accuracy
import accuracy_plot
from accuracy_plot import plot_series, strip_x
from published import Alternative, Result


def _r(set_name: str, measured: float, predicted: float, label: str = "") -> Result:
    return Result(set=set_name, label=label or f"{set_name}-{measured}-{predicted}", engine="megatron-lm",
                  predicted_s=predicted, measured_s=measured)


# step times chosen so that every error is exact in binary: predicted / measured - 1
HAND = [
    _r("a", 2.0, 1.5),    # -0.25
    _r("b", 4.0, 5.0),    # +0.25
    _r("a", 1.0, 1.25),   # +0.25
    _r("c", 1.0, 0.5),    # -0.5
    _r("a", 8.0, 9.0),    # +0.125
    _r("b", 4.0, 3.0),    # -0.25
    _r("d", 16.0, 12.0),  # -0.25
]


def test_series_sets_order_points_errors_medians_counts():
    series = plot_series(HAND, targets=("a", "d"))
    # targets first (d's median -0.25 before a's +0.125), then checks (c's -0.5 before b's 0.0)
    assert [s.name for s in series] == ["d", "a", "c", "b"]
    assert [s.target for s in series] == [True, True, False, False]
    assert [s.count for s in series] == [1, 3, 1, 2]
    by_name = {s.name: s for s in series}
    assert by_name["a"].points == ((2.0, 1.5), (1.0, 1.25), (8.0, 9.0))  # (measured, predicted), bench order
    assert by_name["a"].errors == (-0.25, 0.125, 0.25)  # sorted
    assert by_name["a"].median == 0.125
    assert by_name["b"].points == ((4.0, 5.0), (4.0, 3.0))
    assert by_name["b"].errors == (-0.25, 0.25)
    assert by_name["b"].median == 0.0  # even count: the mean of the middle two
    assert by_name["c"].median == -0.5 and by_name["d"].median == -0.25
    assert sum(s.count for s in series) == len(HAND)


def test_series_ties_broken_by_name_and_tick_labels():
    series = plot_series([_r("z", 1.0, 0.5), _r("y", 2.0, 1.0)], targets=())
    assert [s.name for s in series] == ["y", "z"]
    assert accuracy_plot.tick_label(series[0]) == "y\n1 rows, median -50.0 %"


def test_strip_x_spreads_sorted_points_across_the_column():
    assert strip_x(3, 1) == [3.0]
    assert strip_x(2, 3) == pytest.approx([1.7, 2.0, 2.3], abs=1e-12)
    assert strip_x(0, 5, width=0.4) == pytest.approx([-0.2, -0.1, 0.0, 0.1, 0.2], abs=1e-12)


def _stub_bench(monkeypatch: pytest.MonkeyPatch, drawn: list) -> tuple[list[Result], list[Result]]:
    """The bench's sources replaced by hand-made rows; the plot's writer records what it is given."""
    targets = {"vtrain-multi": [_r("vtrain-multi", 1.0, 1.25)], "vtrain-single": [_r("vtrain-single", 2.0, 1.5)]}
    cal, kor = [_r("calibration", 4.0, 3.0)], [_r("korthikanti-layer", 0.5, 0.5, label="no recompute")]
    checks = [_r("dgxc-h100", 8.0, 7.0, label="row-1")]
    alts = {"row-1": [Alternative(name="other", why="", result=_r("dgxc-h100", 8.0, 100.0, label="row-1"))]}
    monkeypatch.setattr(accuracy, "vtrain_results", lambda name, set_name: targets[set_name])
    monkeypatch.setattr(accuracy.validate_calibration, "calibration_results", lambda: cal)
    monkeypatch.setattr(accuracy.validate_calibration, "korthikanti_results", lambda: kor)
    monkeypatch.setattr(accuracy, "records", lambda path: [])
    monkeypatch.setattr(accuracy, "published_checks", lambda recs, refused=None: (checks, alts))
    monkeypatch.setattr(accuracy, "print_alternatives", lambda checks, alts, recs: None)
    monkeypatch.setattr(accuracy_plot, "write_png", lambda series, path: drawn.append((series, path)))
    return targets["vtrain-multi"] + targets["vtrain-single"] + cal + kor, checks


def test_bench_plots_exactly_the_table_rows_not_the_alternatives(monkeypatch, tmp_path, capsys):
    drawn: list = []
    results, checks = _stub_bench(monkeypatch, drawn)
    assert accuracy.main(["--plot", str(tmp_path / "a.png")]) == 0
    (series, path), = drawn
    assert path == str(tmp_path / "a.png")
    assert series == plot_series(results + checks, accuracy.TARGETS)
    assert {s.name: s.points for s in series}["dgxc-h100"] == ((8.0, 7.0),)  # the alternative's 100 s absent
    assert capsys.readouterr().out.endswith(f"wrote {tmp_path / 'a.png'}\n")
    assert accuracy.main([]) == 0 and len(drawn) == 1  # no --plot: nothing drawn


@pytest.mark.parametrize(("path", "says"), [("a.pdf", "ending in .png"), ("missing/a.png", "no directory")])
def test_bad_plot_path_refused_before_pricing(monkeypatch, tmp_path, capsys, path, says):
    monkeypatch.setattr(accuracy, "vtrain_results", lambda *a: pytest.fail("priced before the check"))
    assert accuracy.main(["--plot", str(tmp_path / path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("accuracy: error: --plot ") and says in err and err.count("\n") == 1


def _png_text_keys(data: bytes) -> list[bytes]:
    """The keywords of the PNG's tEXt / iTXt chunks (length, type, data, CRC after the 8-byte signature)."""
    keys, at = [], 8
    while at < len(data):
        length, kind = int.from_bytes(data[at:at + 4], "big"), data[at + 4:at + 8]
        if kind in (b"tEXt", b"iTXt"):
            keys.append(data[at + 8:at + 8 + length].split(b"\0")[0])
        at += 12 + length
    return keys


def test_png_written_without_software_metadata(tmp_path):
    """Smoke test of the drawing (the data drawn is checked above): a PNG of the figure's 1400 x 700 px
    (IHDR, the first chunk), with no text chunk (matplotlib's default "Software" one names its version)."""
    accuracy_plot.write_png(plot_series(HAND, targets=("a", "d")), tmp_path / "one.png")
    one = (tmp_path / "one.png").read_bytes()
    assert one.startswith(b"\x89PNG\r\n\x1a\n") and one[12:16] == b"IHDR"
    assert (int.from_bytes(one[16:20], "big"), int.from_bytes(one[20:24], "big")) == (1400, 700)
    assert _png_text_keys(one) == []


def test_bench_without_plot_does_not_import_matplotlib():
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import accuracy, accuracy_plot; "
            "from published import Result; accuracy_plot.plot_series([Result('s', 'x', 'e', 1.0, 2.0)], ()); "
            "print('matplotlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(BENCH)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
