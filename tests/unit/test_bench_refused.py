"""bench/accuracy.py on a records file of its own (--records): a record the cost model refuses is one
REFUSED line, counted in its set's line and left out of the figures, and the bench exits 1 after printing
the rest; a malformed file stops it with one line (exit 2) before any pricing."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import accuracy
import validate_calibration
from published import Refused, predict, price, records

GOOD = "torchtitan-llama2-13b-bs2-none"  # FSDP2 over 64 A100s, no pipeline: torchtitan prices it


def _shipped(rid: str) -> dict:
    return copy.deepcopy(next(r for r in records() if r["id"] == rid))


def _refused_pp_zero3() -> dict:
    """The good record on a 2-stage pipeline with ZeRO-3: torchtitan runs stages 0 and 2 only with pp > 1."""
    rec = _shipped(GOOD)
    rec["id"] = "torchtitan-x"
    rec["config"].update(pp=2, dp=32)
    return rec


def _no_ffn() -> dict:
    """A Llama record without its ffn width, alone in a set of its own."""
    rec = _shipped(GOOD)
    rec.update(id="mine-no-ffn", set="mine")
    del rec["model"]["ffn"]
    return rec


def _run(monkeypatch, tmp_path: Path, recs: list[dict], *flags: str) -> int:
    path = tmp_path / "runs.json"
    path.write_text(json.dumps({"records": recs}))
    # the targets (vTrain's 1549 rows, the calibration) are not what is tested: left out for speed
    monkeypatch.setattr(accuracy, "vtrain_results", lambda *a: [])
    monkeypatch.setattr(validate_calibration, "calibration_results", list)
    monkeypatch.setattr(validate_calibration, "korthikanti_results", list)
    monkeypatch.setattr(sys, "argv", ["accuracy.py", "--records", str(path), *flags])
    return accuracy.main()


def test_a_refused_record_is_one_line_counted_and_the_others_are_printed(monkeypatch, tmp_path, capsys):
    recs = [_shipped(GOOD), _refused_pp_zero3(), _no_ffn()]
    assert _run(monkeypatch, tmp_path, recs, "--rows") == 1
    out = capsys.readouterr().out
    good = predict(_shipped(GOOD))
    # the set's figures are the good record's alone, with the refused one counted beside them
    set_line = next(line for line in out.splitlines() if line.startswith("torchtitan-a100"))
    assert accuracy.summary([good]) in set_line and "2 runs, 1 refused" in set_line
    mine = next(line for line in out.splitlines() if line.startswith("mine "))
    assert "(none priced)" in mine and "1 runs, 1 refused" in mine
    assert f"{100 * good.error:+6.1f} %  fits {good.fits}" in out  # the good row of --rows
    assert "runs that ran, predicted to fit: 1 of 1 (2 more refused, not priced)" in out
    assert ("  REFUSED  torchtitan-x: engine 'torchtitan' runs ZeRO stage(s) 0, 2 only with a pipeline"
            in out)
    assert "  REFUSED  mine-no-ffn: model field(s) ['ffn'] missing" in out


def test_a_refused_alternative_is_shown_beside_the_priced_ones(monkeypatch, tmp_path, capsys):
    rec = _shipped("mcore-h100-32B")  # 384 GPUs, tp 8, dp 48
    rec["alternatives"].append({"name": "pp 3", "why": "w", "config": {"pp": 3}})  # 3 x 8 x 48 = 1152 GPUs
    assert _run(monkeypatch, tmp_path, [rec]) == 1
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("  mcore-h100-32B:"))
    # the priced alternatives keep their errors, the refused one says why (1152 of 384 GPUs)
    assert "microbatch 2: +" in line and "microbatch 4: " in line
    assert "pp 3: REFUSED (config uses pp*dp*ep*cp*tp = 1152 devices but cluster 'dgx-h100-80gb' has 384" in line
    assert "  REFUSED  mcore-h100-32B: alternative 'pp 3': config uses" in out


def test_price_names_the_type_of_an_error_that_is_no_refusal(monkeypatch):
    import published

    def boom(rec):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(published, "predict", boom)
    assert price(_shipped(GOOD)) == Refused(set="torchtitan-a100", label=GOOD, engine="torchtitan",
                                            reason="ZeroDivisionError: division by zero")


@pytest.mark.parametrize("edit, says", [
    (lambda r: r.pop("config"), "record 'torchtitan-x': missing key 'config': each record has keys"),
    (lambda r: r.pop("id"), "record #1: missing key 'id'"),
    (lambda r: r["cluster"].pop("gpus"), "record 'torchtitan-x': missing key 'cluster.gpus'"),
    (lambda r: r.update(measured={"wps": 1}), "record 'torchtitan-x': 'measured' has none of"),
    (lambda r: r.update(id=GOOD), f"record {GOOD!r}: duplicate id"),
])
def test_a_malformed_record_stops_the_bench_with_one_line(monkeypatch, tmp_path, capsys, edit, says):
    bad = _refused_pp_zero3()
    edit(bad)
    monkeypatch.setattr(accuracy, "published_checks", lambda *a: pytest.fail("priced before the check"))
    assert _run(monkeypatch, tmp_path, [_shipped(GOOD), bad]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"accuracy: error: {tmp_path / 'runs.json'}: {says}") and "\n" not in err


def test_a_file_that_is_not_json_is_one_line(tmp_path):
    path = tmp_path / "runs.json"
    path.write_text('{"records": [{"id": 1,}]}')
    with pytest.raises(ValueError) as err:
        records(path)
    assert str(err.value).startswith(f"{path}: not a records file (JSONDecodeError: ") and "\n" not in str(err.value)


def test_a_pair_with_a_refused_run_is_not_compared(capsys):
    """SC'21 Table 2 pairs: a pair whose PTD-P run was refused is named, not compared, not counted right."""
    from published import Result

    recs = [{"id": f"sc21-t2-{kind}-175B-{gpus}", "pair": f"175B-{gpus}"} for kind in ("zero3", "ptdp")
            for gpus in (384, 768)]
    results = [Result(set="s", label=f"sc21-t2-{kind}-175B-{gpus}", engine="e", predicted_s=p, measured_s=m)
               for kind, gpus, p, m in [("zero3", 384, 2.0, 2.0), ("zero3", 768, 3.0, 3.0), ("ptdp", 768, 1.0, 1.5)]]
    accuracy.print_pairs(results, recs)
    out = capsys.readouterr().out
    assert "175B on  384 GPUs: not compared" in out
    assert "175B on  768 GPUs: x2.00 published, x3.00 predicted" in out  # 3.0 / 1.5 and 3.0 / 1.0
    assert "1 of 1 pairs in the published order" in out  # the pair not compared is not counted
