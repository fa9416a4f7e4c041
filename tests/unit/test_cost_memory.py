"""Memory formulas: Korthikanti et al. 2022 Table 2 activations, ZeRO model states, in-flight microbatches."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st
from test_cost_graph_helper import a100_cluster, gpt_graph

from autoplan.cost import estimate_layer, in_flight_microbatches, model_state_bytes
from autoplan.plan.engine import Engine
from autoplan.plan.types import ParallelConfig, Recompute, Schedule

S, B, H, A = 2048, 2, 4096, 32
GRAPH = gpt_graph(h=H, a=A, layers=1, seq=S)
BLOCK = GRAPH.blocks[0]
CLUSTER = a100_cluster(1)
MEGATRON = Engine.load("megatron-lm")


def _act(tp: int = 1, sp: bool = False, recompute: str = "none", engine: Engine = MEGATRON) -> int:
    cfg = ParallelConfig(tp=tp, dp=8 // tp, sp=sp, microbatch=B)
    return estimate_layer(BLOCK, CLUSTER, cfg, recompute, seq_len=S, engine=engine).act_mem_bytes


def test_korthikanti_table_2() -> None:
    """Megatron keeps the sequence-parallel shard of each linear's input (and re-gathers it in backward)."""
    sbh, score = S * B * H, 5 * A * S / H
    assert math.isclose(_act(), sbh * (34 + score), rel_tol=1e-9)
    assert math.isclose(_act(tp=4), sbh * (10 + 24 / 4 + score / 4), rel_tol=1e-9)
    assert math.isclose(_act(tp=4, sp=True), sbh * (34 / 4 + score / 4), rel_tol=1e-9)
    assert math.isclose(_act(tp=4, sp=True, recompute="selective"), sbh * 34 / 4, rel_tol=1e-9)
    assert math.isclose(_act(recompute="full"), 2 * sbh, rel_tol=1e-9)
    assert math.isclose(_act(tp=4, sp=True, recompute="full"), 2 * sbh / 4, rel_tol=1e-9)


def test_flash_attention_stores_no_scores() -> None:
    flash = gpt_graph(h=H, a=A, layers=1, seq=S, unfused=False).blocks[0]
    cost = estimate_layer(flash, CLUSTER, ParallelConfig(dp=8, microbatch=B), "none", seq_len=S)
    assert math.isclose(cost.act_mem_bytes, S * B * H * 34, rel_tol=1e-9)


def test_zero_stages_divide_model_states() -> None:
    cfg = {z: ParallelConfig(dp=8, zero=z) for z in range(4)}
    psi = 1e9
    assert model_state_bytes(psi, 0, cfg[0]) == (2 * psi, 2 * psi, 12 * psi)  # 16 bytes per parameter
    assert model_state_bytes(psi, 0, cfg[1]) == (2 * psi, 2 * psi, 12 * psi / 8)
    assert model_state_bytes(psi, 0, cfg[2]) == (2 * psi, 2 * psi / 8, 12 * psi / 8)
    assert model_state_bytes(psi, 0, cfg[3]) == (2 * psi / 8, 2 * psi / 8, 12 * psi / 8)
    moe = ParallelConfig(dp=2, ep=4, zero=3)  # dense shards over dp*ep = 8, experts over dp = 2
    assert model_state_bytes(8e9, 2e9, moe)[0] == 2 * (8e9 / 8 + 2e9 / 2)


def test_in_flight_microbatches_per_schedule() -> None:
    assert in_flight_microbatches(Schedule.ONE_F_ONE_B, 8, 1, 64, 0) == 8
    assert in_flight_microbatches(Schedule.ONE_F_ONE_B, 8, 1, 64, 7) == 1
    assert in_flight_microbatches(Schedule.ONE_F_ONE_B, 8, 1, 4, 0) == 4
    assert in_flight_microbatches(Schedule.GPIPE, 8, 1, 64, 3) == 64
    assert math.isclose(in_flight_microbatches(Schedule.INTERLEAVED, 8, 4, 64, 0), 8 * (1 + 7 / 32))
    assert in_flight_microbatches(Schedule.ZERO_BUBBLE, 8, 1, 64, 0) == 8


@settings(max_examples=25, deadline=None)
@given(tp=st.sampled_from([1, 2, 4, 8]), sp=st.booleans(), b=st.integers(1, 4))
def test_recompute_orders_activation_memory(tp: int, sp: bool, b: int) -> None:
    cfg = ParallelConfig(tp=tp, dp=8 // tp, sp=sp, microbatch=b)
    none, sel, full = (estimate_layer(BLOCK, CLUSTER, cfg, r, seq_len=S).act_mem_bytes for r in Recompute)
    assert none >= sel >= full > 0


@settings(max_examples=20, deadline=None)
@given(tp=st.sampled_from([1, 2, 4]))
def test_more_tp_holds_fewer_weights(tp: int) -> None:
    def held(t: int) -> int:
        return estimate_layer(BLOCK, CLUSTER, ParallelConfig(tp=t, dp=8 // t), "none", seq_len=S).param_count

    assert held(2 * tp) < held(tp)
    assert math.isclose(held(1) / held(2 * tp), 2 * tp, rel_tol=1e-3)


def test_autoplan_executor_keeps_the_gathered_linear_inputs_under_sp() -> None:
    """autoplan's executor (DTensor ColwiseParallel after PrepareModuleInput) keeps the QKV and MLP inputs
    all-gathered: with SP only the norms' inputs and the dropout masks (6h of Korthikanti's 10h) shrink by
    t, the 2h + 2h linear inputs stay whole: s b h (6/t + 4 + 24/t + 5 a s / (h t)) at tp = t = 4."""
    sbh, score = S * B * H, 5 * A * S / H
    own = Engine.load("autoplan")
    assert math.isclose(_act(tp=4, sp=True, engine=own), sbh * (6 / 4 + 4 + 24 / 4 + score / 4), rel_tol=1e-9)
    assert _act(tp=4, engine=own) == _act(tp=4)  # without SP nothing is sharded over the sequence
    assert math.isclose(_act(tp=4, sp=True, recompute="selective", engine=own), sbh * (6 / 4 + 4 + 24 / 4),
                        rel_tol=1e-9)


def test_repeated_kv_heads_are_kept_at_the_query_width() -> None:
    """Grouped-query attention, 32 heads over 8 kv heads, flash (no scores): Megatron-Core keeps K and V at
    the kv heads (4 h g / a = h bytes per token), autoplan's executor and torchtitan keep them repeated to
    the query heads (4h): 3h more bytes per token."""
    block = gpt_graph(h=H, a=A, kv=8, layers=1, seq=S, unfused=False).blocks[0]
    cfg = ParallelConfig(dp=8, microbatch=B)
    kept = {name: estimate_layer(block, CLUSTER, cfg, "none", seq_len=S, engine=Engine.load(name)).act_mem_bytes
            for name in ("megatron-core", "autoplan", "torchtitan")}
    assert math.isclose(kept["autoplan"] - kept["megatron-core"], S * B * 3 * H, rel_tol=1e-9)
    assert kept["torchtitan"] == kept["autoplan"]
