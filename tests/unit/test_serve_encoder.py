"""Serving a model with components (encode -> prefill -> decode) against hand computations: the encoder
pass is compute-bound at the GEMM rate, TP adds two all-reduces per encoder block, the image tokens
lengthen the prefill, TTFT includes the encoder (co-located: its share of each prefill token; its own
group: the pass, the queue and the hand-off of the features over the link), and the search tries both.

The hand-built model: a CLIP ViT-L/14-336-like encoder (24 blocks, h 1024, MLP 4096, 16 heads, 577
tokens per image, 576 handed to the LM at h 4096) in front of Llama 3 8B, on H100s with the
zero-overhead engine (physics only)."""

from __future__ import annotations

import dataclasses

import pytest
from serve_helpers import LLAMA3_8B, bare_engine

import autoplan
from autoplan.cluster.load import Cluster
from autoplan.cost.comm import all_reduce_s
from autoplan.cost.types import GroupPlacement
from autoplan.serve.encoder import encode_s, handoff_s
from autoplan.serve.estimate import estimate_serving
from autoplan.serve.physics import Hardware
from autoplan.serve.search import ServeSearchOptions, search
from autoplan.serve.types import ServeConfig, ServeEncoder, Workload

H, F, S, BLOCKS = 1024, 4096, 577, 24
ENCODER = ServeEncoder(name="tower", matmul_flops=2.0 * S * (4 * H * H + 2 * H * F) * BLOCKS,
                       attention_flops=4.0 * S * S * H * BLOCKS, num_blocks=BLOCKS, tokens=S, h=H, a=16,
                       params=BLOCKS * (4 * H * H + 2 * H * F), handoff_bytes=576 * 4096 * 2.0, output_tokens=576)
MODEL = dataclasses.replace(LLAMA3_8B, name="llava-like", encoder=ENCODER)


def _hw(engine=None) -> Hardware:
    spec = Cluster.load("dgx-h100-80gb")
    return Hardware(cluster=spec, engine=engine or bare_engine(), peak_flops=spec.device.peak("bf16"),
                    attention_peak_flops=spec.device.peak("bf16"))


def test_encode_time_is_the_encoder_flops_at_the_gemm_rate() -> None:
    hw = _hw()
    dev = hw.cluster.device
    peak = dev.peak("bf16")  # 989 TFLOP/s, H100 SXM datasheet
    bw = dev.mem_bw_bytes_per_s * dev.mem_bw_efficiency
    images = 2
    gemm = images * ENCODER.matmul_flops / (peak * dev.matmul_efficiency)
    attention = images * ENCODER.attention_flops / (peak * dev.attention_efficiency)
    elementwise = BLOCKS * images * S * 10 * H * 2 / bw
    assert gemm > ENCODER.params * 2 / bw  # compute-bound, like prefill
    assert encode_s(ENCODER, images, tp=1, act_bytes=2.0, hw=hw) == pytest.approx(gemm + attention + elementwise)


def test_encoder_tensor_parallelism_halves_the_flops_and_pays_two_all_reduces_per_block() -> None:
    hw = _hw()
    dev = hw.cluster.device
    one = encode_s(ENCODER, 1, tp=1, act_bytes=2.0, hw=hw)
    two = encode_s(ENCODER, 1, tp=2, act_bytes=2.0, hw=hw)
    elementwise = BLOCKS * S * 10 * H * 2 / (dev.mem_bw_bytes_per_s * dev.mem_bw_efficiency)  # not split by tp
    message = S * H * 2  # tokens x h in bf16; the bare engine has no custom all-reduce: NCCL's ring in a node
    ring = all_reduce_s(message, GroupPlacement(size=2, num_nodes=1, per_node=2), hw.cluster)
    assert ring > 0
    assert two == pytest.approx((one - elementwise) / 2 + elementwise + BLOCKS * 2 * ring)


def test_the_image_tokens_lengthen_the_prefill_and_fill_the_kv_cache() -> None:
    hw = _hw()
    config = ServeConfig(tp=1)
    with_images = estimate_serving(MODEL, hw, config, Workload(input_len=100, output_len=50, concurrency=1,
                                                               images_per_request=2))
    text_only = estimate_serving(LLAMA3_8B, hw, config, Workload(input_len=100 + 2 * 576, output_len=50,
                                                                 concurrency=1))
    assert with_images.tpot_s == pytest.approx(text_only.tpot_s)
    assert with_images.max_concurrency == text_only.max_concurrency  # 1252 + 50 tokens of KV per request
    # co-located: one request's prefill carries its whole encoder pass
    enc = encode_s(ENCODER, 2, tp=1, act_bytes=2.0, hw=hw)
    assert with_images.encode_s == pytest.approx(enc)
    assert with_images.ttft_s == pytest.approx(text_only.ttft_s + enc, rel=1e-9)
    # the encoder's weights sit on the prefill devices: less room for the KV cache
    assert with_images.kv_cache_bytes_per_gpu == pytest.approx(text_only.kv_cache_bytes_per_gpu - ENCODER.params * 2)


def test_an_encoder_group_of_its_own_adds_its_pass_and_the_hand_off_to_ttft() -> None:
    hw = _hw()
    work = Workload(input_len=100, output_len=50, concurrency=1, images_per_request=1)
    own = estimate_serving(MODEL, hw, ServeConfig(tp=1, encoder_tp=2, encoder_replicas=1), work)
    text_only = estimate_serving(LLAMA3_8B, hw, ServeConfig(tp=1),
                                 Workload(input_len=676, output_len=50, concurrency=1))
    link = hw.cluster.intra_node  # 3 devices: one node, NVLink; NCCL's fixed cost per call, then alpha-beta
    handoff = link.base_latency_s + link.latency_s + 576 * 4096 * 2 / (link.bw_bytes_per_s * link.p2p_bw_fraction)
    assert own.encoder_handoff_s == pytest.approx(handoff)
    assert handoff_s(ENCODER, 1, crosses_nodes=False, hw=hw) == pytest.approx(handoff)
    enc = encode_s(ENCODER, 1, tp=2, act_bytes=2.0, hw=hw)
    # one client: no queue at the encoder; the language model's TTFT is the text-only one's
    assert own.encode_queue_s == 0.0
    assert own.ttft_s == pytest.approx(text_only.ttft_s + enc + handoff, rel=1e-6)
    assert own.tpot_s == pytest.approx(text_only.tpot_s, rel=1e-6)
    assert own.tokens_per_s_per_gpu == pytest.approx(own.tokens_per_s / 3)  # 1 LM + 2 encoder devices


def test_open_loop_encoder_queue_is_md1() -> None:
    hw = _hw()
    work = Workload(input_len=100, output_len=50, rate=200.0, images_per_request=4)
    own = estimate_serving(MODEL, hw, ServeConfig(tp=1, replicas=2, encoder_replicas=2), work)
    service = encode_s(ENCODER, 4, tp=1, act_bytes=2.0, hw=hw)
    rho = 200.0 / 2 * service  # Poisson arrivals split over two encoder instances
    assert 0 < rho < 1
    assert own.encode_queue_s == pytest.approx(rho * service / (2 * (1 - rho)))  # Pollaczek-Khinchine
    assert own.queue_s >= own.encode_queue_s
    # past the encoders' capacity the plan is unstable
    over = estimate_serving(MODEL, hw, ServeConfig(tp=1, replicas=2, encoder_replicas=1),
                            dataclasses.replace(work, rate=1.05 / service))
    assert not over.stable


def test_a_closed_loop_through_a_saturated_encoder_waits_there() -> None:
    hw = _hw()
    # a pooling encoder (one token per image): the language model's prefill is short, the encoder the bottleneck
    pooled = dataclasses.replace(MODEL, encoder=dataclasses.replace(ENCODER, output_tokens=1, handoff_bytes=8192.0))
    work = Workload(input_len=100, output_len=2, concurrency=64, images_per_request=8)
    est = estimate_serving(pooled, hw, ServeConfig(tp=1, replicas=4, encoder_replicas=1), work)
    service = encode_s(ENCODER, 8, tp=1, act_bytes=2.0, hw=hw)
    # one encoder instance serves at most 1 / S requests per second, and the queue before it holds the rest
    assert est.request_rate <= 1.0 / service * (1 + 1e-6)
    assert est.request_rate == pytest.approx(1.0 / service, rel=0.02)
    assert est.encode_queue_s > 10 * service


def test_the_search_tries_the_encoder_on_its_own_devices_and_co_located() -> None:
    hw = _hw()
    work = Workload(input_len=100, output_len=100, concurrency=32, images_per_request=4)
    scored = search(MODEL, hw, work, tpot_slo_s=0.05, opts=ServeSearchOptions(pp=(1,), max_batch=(64,), disaggregated=False))
    kinds = {s.config.encoder_replicas > 0 for s in scored}
    assert kinds == {True, False}
    assert all(s.config.num_devices <= 8 for s in scored)
    for s in scored:
        if s.config.encoder_replicas:
            assert s.estimate.encoder_handoff_s > 0 and s.config.encode_devices == s.config.encoder_tp * s.config.encoder_replicas


def test_serve_plan_of_tiny_llava_counts_its_image_tokens() -> None:
    est = autoplan.serve_estimate("tiny-llava", "local-cpu", {"tp": 1}, input_len=8, output_len=4, concurrency=1)
    assert est.encode_s > 0  # one image by default
    none = autoplan.serve_estimate("tiny-llava", "local-cpu", {"tp": 1}, input_len=8, output_len=4, concurrency=1,
                                   images_per_request=0)
    assert none.encode_s == 0 and none.ttft_s < est.ttft_s
    plans = autoplan.serve_plan("tiny-llava", "local-cpu", input_len=8, output_len=4, concurrency=2, top_k=2,
                                tp=1, pp=1, max_batch=8, disaggregated=False, encoder_replicas=(1,))
    assert all(p.config.encoder_replicas == 1 for p in plans)
    assert "E 1 x tp1 + " in plans.table() and "Encode: 1 image(s) per request" in plans.best.explain()


def test_encoder_options_on_a_model_without_an_encoder_are_one_line() -> None:
    with pytest.raises(ValueError, match="tiny-llama has no encoder"):
        autoplan.serve_estimate("tiny-llama", "local-cpu", {"tp": 1}, input_len=8, output_len=4, concurrency=1,
                                images_per_request=1)
    with pytest.raises(ValueError, match="encoder_replicas=1: tiny-llama has no encoder"):
        autoplan.serve_estimate("tiny-llama", "local-cpu", {"encoder_replicas": 1}, input_len=8, output_len=4,
                                concurrency=1)
    with pytest.raises(ValueError, match="encoder_tp=3 does not divide the encoder's 16 attention heads"):
        estimate_serving(MODEL, _hw(), ServeConfig(encoder_tp=3, encoder_replicas=1),
                         Workload(input_len=8, output_len=4, concurrency=1, images_per_request=1))
    with pytest.raises(ValueError, match="encoder_tp=2 needs encoder_replicas >= 1"):
        ServeConfig(encoder_tp=2)


def test_cli_serve_of_a_model_with_an_encoder(capsys) -> None:
    from autoplan.cli.main import main

    assert main(["serve", "--model", "tiny-llava", "--cluster", "local-cpu", "--input-len", "8", "--output-len", "4",
                 "--concurrency", "2", "--images-per-request", "2", "--tp", "1", "--pp", "1", "--max-batch", "8",
                 "--aggregated-only", "--top-k", "2"]) == 0
    assert "Encode: 2 image(s) per request" in capsys.readouterr().out
    assert main(["serve", "--model", "tiny-llama", "--cluster", "local-cpu", "--input-len", "8", "--output-len", "4",
                 "--concurrency", "1", "--images-per-request", "1"]) == 2
    assert "autoplan: error: images_per_request=1: tiny-llama has no encoder" in capsys.readouterr().err
