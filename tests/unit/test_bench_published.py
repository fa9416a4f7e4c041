"""bench/published.py's FLOP counts (the measured step of a record comes from them) against hand computations."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from graphs import gpt_graph
from published import (
    embeddings_weighted_stages,
    measured_step_s,
    megatron_core_flops,
    megatron_flops,
    padded_vocab,
    records,
)


def _by_gemm(*, B: int, s: int, l: int, h: int, V: int, a: int, g: int, f: int, gated: bool) -> float:
    """Every matmul of one iteration, counted one by one: 2 FLOPs a multiply-add, backward twice forward."""
    d = h // a
    per_token_layer = (2 * h * (a + 2 * g) * d      # QKV projection
                       + 2 * a * d * h               # attention output projection
                       + 2 * s * a * d + 2 * s * a * d  # Q K^T and scores x V over all s keys (no causal halving)
                       + 2 * h * f * (3 if gated else 2))  # MLP: fc1 (gate + up when gated) and fc2
    forward = B * s * (l * per_token_layer + 2 * h * V)  # + the logits
    return 3.0 * forward


def test_megatron_core_flops_counts_every_gemm_gpt():
    args = {"B": 192, "s": 4096, "l": 24, "h": 2048, "V": 131072, "a": 16}
    assert megatron_core_flops(**args) == pytest.approx(_by_gemm(**args, g=16, f=4 * 2048, gated=False), rel=1e-12)


def test_megatron_core_flops_counts_every_gemm_gqa_swiglu():
    args = {"B": 8, "s": 2048, "l": 4, "h": 4096, "V": 32000, "a": 32}
    got = megatron_core_flops(**args, ffn=11008, kv_heads=8, swiglu=True)
    assert got == pytest.approx(_by_gemm(**args, g=8, f=11008, gated=True), rel=1e-12)


def test_megatron_core_flops_is_the_sc21_count_without_recompute():
    # Narayanan et al. 2021 count a full recompute of the blocks (4 passes instead of 3), the logits' 6 B s h V once
    args = {"B": 1536, "s": 2048, "l": 96, "h": 12288, "V": 51200}
    logits = 6.0 * 1536 * 2048 * 12288 * 51200
    assert megatron_core_flops(**args, a=96) == pytest.approx(0.75 * (megatron_flops(**args) - logits) + logits,
                                                              rel=1e-12)


def test_padded_vocab_rounds_up_to_128_tp():
    assert padded_vocab(131072, 8) == 131072
    assert padded_vocab(50257, 1) == 50304      # GPT-2's 50257 -> 393 x 128
    assert padded_vocab(50257, 8) == 51200      # 50 x 1024


def test_untied_gpt_has_no_tied_embedding():
    kw = {"h": 64, "a": 4, "layers": 2, "seq": 16, "vocab": 100}
    assert gpt_graph(**kw).tied_embedding_params == 100 * 64
    assert gpt_graph(**kw, tied=False).tied_embedding_params == 0


def _megascale_12288(measured: dict) -> dict:
    """MegaScale Table 2's Megatron-LM run on 12,288 GPUs (175B: 96 layers, h 12288, 128 heads, V 64,000 padded
    to 64,512, batch 6144 of 2048 tokens, TP 8)."""
    return {"model": {"family": "gpt", "hidden": 12288, "heads": 128, "layers": 96, "vocab": 64512, "seq_len": 2048},
            "config": {"tp": 8}, "cluster": {"gpus": 12288}, "global_batch": 6144, "measured": measured}


def test_mfu_megatron_core_flops_step_by_hand():
    # 72 B s l h^2 (1 + s/6h + V/12lh) over MFU x 312 TFLOP/s x GPUs, written out
    flops = 72.0 * 6144 * 2048 * 96 * 12288**2 * (1 + 2048 / (6 * 12288) + 64512 / (12 * 96 * 12288))
    got = measured_step_s(_megascale_12288({"mfu_megatron_core_flops": 0.412}), 312e12, model_flops=0.0)
    assert got == pytest.approx(flops / (0.412 * 312e12 * 12288), rel=1e-12)
    assert got == pytest.approx(8.57, rel=3e-3)  # the paper's own iteration time for that row


def test_published_iteration_time_wins_over_mfu():
    rec = _megascale_12288({"iteration_time_s": 8.57, "mfu_megatron_core_flops": 0.5})
    assert measured_step_s(rec, 312e12, model_flops=0.0) == 8.57


def test_megascale_table2_columns_agree_through_the_flop_count():
    # each Megatron-LM row's MFU, through Megatron-Core's FLOP count and A100's 312 TFLOP/s, gives its published
    # iteration time, and batch x 2048 / iteration time its throughput, to the table's rounding; 6N (N = 174.8 B)
    # or SC'21's count with the recompute would miss by 2.7 % and 33 %
    rows = [r for r in records() if r["id"].startswith("megascale-t2-")]
    assert len(rows) == 8
    for rec in rows:
        m = rec["measured"]
        from_mfu = measured_step_s({**rec, "measured": {"mfu_megatron_core_flops": m["mfu_megatron_core_flops"]}},
                                   312e12, model_flops=0.0)
        assert from_mfu == pytest.approx(m["iteration_time_s"], rel=5e-3), rec["id"]
        assert rec["global_batch"] * 2048 / m["iteration_time_s"] == pytest.approx(m["throughput_tokens_per_s"],
                                                                                   rel=5e-3), rec["id"]
        assert rec["config"]["dp"] * 64 == rec["cluster"]["gpus"]


def test_bloom_logged_tflops_are_the_sc21_count_over_the_elapsed_time():
    """BigScience's logs print TFLOPs next to the elapsed time per iteration: the SC'21 count with full
    recompute (96 B s l h^2 (1 + s / 6h + V / 16lh), V = 250880) over time x 384 GPUs reproduces each to the
    printed digits, so the records' iteration_time_s and their TFLOPs say the same thing."""
    bloom = [r for r in records() if r["set"] == "bloom-176b"]
    assert len(bloom) == 3
    for rec in bloom:
        m, model = rec["measured"], rec["model"]
        flops = megatron_flops(B=rec["global_batch"], s=model["seq_len"], l=model["layers"], h=model["hidden"],
                               V=model["vocab"])
        tflops = flops / (m["iteration_time_s"] * rec["cluster"]["gpus"]) / 1e12
        assert tflops == pytest.approx(m["tflops_per_gpu_with_recompute"], abs=0.006), rec["id"]


def test_embeddings_weighted_stages_give_the_embedding_and_head_a_block_each():
    """70 blocks + 2 embeddings over 12 stages (BLOOM): 6 weighted layers per stage, the embedding in the
    first with 5 blocks, the head in the last with 5; a count that does not divide is refused."""
    stages = embeddings_weighted_stages(gpt_graph(h=64, a=4, layers=70, seq=16, vocab=100), 12)
    assert [len(st) for st in stages] == [6] * 12
    assert stages[0][0] == "embed" and stages[-1][-1] == "head"
    assert stages[0][1:] == tuple(f"layers.{i}" for i in range(5)) and stages[1][0] == "layers.5"
    with pytest.raises(ValueError, match="do not split evenly"):
        embeddings_weighted_stages(gpt_graph(h=64, a=4, layers=69, seq=16, vocab=100), 12)
@pytest.mark.parametrize("rid", ["llama3-405b-8192-cp1", "llama3-405b-16384-cp1", "llama3-405b-16384-cp16"])
def test_llama3_measured_step_is_palm_mfu_over_the_full_attention_square(rid):
    """Dubey et al. 2024 Table 4 gives BF16 MFU after Chowdhery et al. (PaLM, appendix B): 6 N + 12 L H Q T
    FLOPs per token, N the matmul parameters (126 blocks + the output head; the embedding lookup is no
    matmul), attention over the whole T x T square, no causal halving. The record's step is those FLOPs
    over MFU x 989 TFLOP/s x GPUs: at 128K the attention term is 57 % of them (a causal count would make
    the measured step 29 % shorter)."""
    from published import predict, records

    rec = next(r for r in records() if r["id"] == rid)
    h, f, layers, vocab, s = 16384, 53248, 126, 128256, rec["model"]["seq_len"]
    qkv = h + 2 * h * 8 // 128  # GQA: 128 query heads, 8 kv heads
    n = layers * (h * qkv + h * h + 3 * h * f) + vocab * h
    per_token = 6.0 * n + 12.0 * layers * h * s
    hand = per_token * rec["global_batch"] * s / (rec["measured"]["mfu"] * 989e12 * rec["cluster"]["gpus"])
    assert predict(rec).measured_s == pytest.approx(hand, rel=1e-9)


def _record(rid: str) -> dict:
    from published import records

    return next(r for r in records() if r["id"] == rid)


def test_an_alternative_is_priced_as_the_record_with_those_fields():
    """mcore-h100-119B's 'V 1' and bloom-176b-tp8-dp4's launch_blocking false, against the records built by
    hand with those fields changed (the other config and engine_overrides kept)."""
    import copy

    from published import alternatives, predict

    for rid, name, edit in [
        ("mcore-h100-119B", "V 1 (no interleaving)",
         lambda r: r["config"].update(schedule="1f1b", virtual_stages=1)),
        ("bloom-176b-tp8-dp4", "no CUDA_LAUNCH_BLOCKING", lambda r: r["engine_overrides"].update(launch_blocking=False)),
    ]:
        rec = _record(rid)
        hand = copy.deepcopy(rec)
        del hand["alternatives"]
        edit(hand)
        alt = next(a for a in alternatives(rec) if a.name == name)
        assert alt.result.predicted_s == predict(hand).predicted_s, rid
        assert alt.result.measured_s == predict(hand).measured_s, rid
        assert alt.result.predicted_s != predict(rec).predicted_s, rid  # the alternative changes the price


def test_alternatives_do_not_enter_the_set_summaries():
    """bench/accuracy.py's summaries see one Result per record, priced with the recorded settings: the same
    line as for the records stripped of their alternatives, which themselves price differently."""
    import accuracy
    from published import predict

    recs = [_record("mcore-h100-119B"), _record("megascale-t2-175B-256")]
    checks, alts = accuracy.published_checks(recs)
    bare = [predict({k: v for k, v in rec.items() if k != "alternatives"}) for rec in recs]
    assert [r.predicted_s for r in checks] == [r.predicted_s for r in bare]
    assert accuracy.summary(checks) == accuracy.summary(bare)
    assert set(alts) == {rec["id"] for rec in recs} and all(alts.values())
    assert any(a.result.predicted_s != checks[0].predicted_s for a in alts["mcore-h100-119B"])


@pytest.mark.parametrize("alt, says", [
    ({"name": "typo", "why": "w", "config": {"microbatchez": 2}}, "unknown config field(s) ['microbatchez']"),
    ({"name": "typo", "why": "w", "engine_overrides": {"launch_blockin": False}},
     "unknown engine_overrides field(s) ['launch_blockin']"),
    ({"name": "typo", "why": "w", "configs": {"microbatch": 2}}, "unknown key(s) ['configs']"),
    ({"name": "typo", "why": "w"}, "changes nothing"),
])
def test_a_bad_alternative_is_one_line_naming_the_record(alt, says):
    from published import alternatives

    rec = {**_record("mcore-h100-32B"), "alternatives": [alt]}
    with pytest.raises(ValueError) as err:
        alternatives(rec)
    assert str(err.value).startswith("mcore-h100-32B: alternative 'typo': ") and "\n" not in str(err.value)
    assert says in str(err.value)


def test_the_bench_stops_on_a_bad_alternative_before_pricing(monkeypatch, capsys):
    import accuracy

    bad = {**_record("mcore-h100-32B"), "alternatives": [{"name": "typo", "why": "w", "config": {"mb": 2}}]}
    monkeypatch.setattr(accuracy, "records", lambda path: [bad])
    monkeypatch.setattr(accuracy, "vtrain_results", lambda *a: pytest.fail("priced before the check"))
    monkeypatch.setattr(sys, "argv", ["accuracy.py"])
    assert accuracy.main() == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("accuracy: error: mcore-h100-32B: alternative 'typo': unknown config field") and "\n" not in err


def test_every_shipped_alternative_is_well_formed():
    from published import check_alternative, records

    alts = [(rec, alt) for rec in records() for alt in rec.get("alternatives", [])]
    assert len(alts) > 20
    for rec, alt in alts:
        check_alternative(rec, alt)
