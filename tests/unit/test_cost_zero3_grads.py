"""Engine.zero3_small_grad_hooks (engines/deepspeed.yaml; cost/zero3_grads.py): DeepSpeed 2021 stage 3 hooks
every parameter's gradient, a Megatron GPT block's biases and LayerNorms included, and a hook flushes the
bucket its gradient would overflow. Checked against the bucket sequence worked out by hand from the hook
order (gpt_grad_hooks), the time a bucket flushed just before a fetch adds, the quick estimate's share,
and that the exact model and the quick estimate both grow with it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_cost_graph_helper import a100_cluster, gpt_graph, quick_and_exact

from autoplan import cost
from autoplan.cost.zero3_grads import Bucket, block_hooks, fetch_wait_share, gpt_grad_hooks
from autoplan.plan.engine import Engine

DS = cost.deepspeed
H = 20480.0  # the 530B model of SC'21 Table 2
F = 4 * H
NUMELS = [3 * H * H, H * H, H * F, F * H]  # QKV, projection, fc1, fc2
SMALL = [H, H, 3 * H, H, H, H, F, H]  # ln1 w, b, QKV bias, projection bias, ln2 w, b, fc1 bias, fc2 bias
LIMIT = 500_000_000  # reduce_bucket_size


def _engine(**changes) -> Engine:
    base = dataclasses.replace(Engine.load("deepspeed"), zero3_sync_per_module=False)
    return dataclasses.replace(base, **changes)


def _layers(count: int, small, bwd: float = 2.0):
    return [DS.block_modules(NUMELS, 1.0, bwd, 1.0, 0.0, False, small) for _ in range(count)]


def test_the_engines_set_the_field_from_their_code() -> None:
    assert Engine.load("deepspeed").zero3_small_grad_hooks
    assert not Engine.load("autoplan").zero3_small_grad_hooks
    assert not Engine.load("deepspeed-2024").zero3_small_grad_hooks


def test_small_gradients_flush_the_buckets_in_autograds_order() -> None:
    """Two 530B blocks, backward by hand (hook order fc2 bias | fc2 W | fc1 bias | fc1 W | ln2 w, b, proj
    bias | proj W | QKV W, bias | ln1 w, b; a hook reduces the bucket it would overflow): top block [fc2 b]
    at fc2 W, [fc2 W] at fc1 b, [fc1 b] at fc1 W, [fc1 W] at ln2 w, [ln2, proj b, proj W] at QKV W, [QKV W]
    at QKV b; the next block starts with [QKV b, ln1] + fc2 b = 6 h, then as the first; the last bucket is
    [QKV b, ln1] = 5 h. Without the small parameters: [fc2], [fc1], [proj], [QKV], [fc2], ... as before."""
    for small, want in (
            (SMALL, [H, F * H, F, H * F, H * H + 3 * H, 3 * H * H, 6 * H, F * H, F, H * F, H * H + 3 * H, 3 * H * H,
                     5 * H]),
            ((), [F * H, H * F, H * H, 3 * H * H, F * H, H * F, H * H, 3 * H * H])):
        reduced: list[float] = []

        def reduce(numel: float, out=reduced) -> float:
            out.append(numel)
            return 0.0

        DS.microbatch_s(_layers(2, small), _engine(), recompute=False, gather_s=lambda n: 0.0, reduce_s=reduce)
        assert reduced == pytest.approx(want)


def test_a_bucket_flushed_before_a_fetch_is_reduced_beside_no_compute() -> None:
    """One 530B block, gather g per module, r per large bucket (tiny ones free), every module's backward
    longer than 2 r. Without the small gradients each bucket reduces beside the next module's backward and
    only the last follows it: 4 g + BWD + r. With them fc2's and fc1's buckets are flushed by the fc1 bias
    and LayerNorm 2 hooks before the fc1 and projection fetches, which wait for them (+ 2 r), and the two
    at QKV (projection's, then QKV's) run beside its backward, the last bucket being tiny: 4 g + BWD + 2 r."""
    g, r, bwd = 1e-3, 1e-2, 10.0

    def reduce(n: float) -> float:
        return r if n > 1e8 else 0.0

    off = DS.microbatch_s(_layers(1, (), bwd), _engine(), recompute=False, gather_s=lambda n: g, reduce_s=reduce)[1]
    on = DS.microbatch_s(_layers(1, SMALL, bwd), _engine(), recompute=False, gather_s=lambda n: g, reduce_s=reduce)[1]
    assert off == pytest.approx(4 * g + bwd + r)
    assert on == pytest.approx(4 * g + bwd + 2 * r)


def test_a_bucket_of_one_gradient_is_priced_apart() -> None:
    """DeepSpeed's flatten of a one-gradient bucket is a view (torch::utils::flatten_dense_tensors), so
    cost.dataparallel prices it with one pass fewer (single_s). Gradients 4, 4, 4, 8 into 10-element
    buckets, by hand: the third 4 flushes [4, 4] (two gradients: reduce_s(8)), the 8 flushes [4] (one:
    single_s(4)), the end flushes [8] (single_s(8))."""
    bucket = Bucket(limit=10, reduce_s=lambda n: 100.0 + n, single_s=lambda n: n)
    assert bucket.arrive([4, 4, 4, 8]) == (108.0, 4.0)
    assert bucket.flush() == 8.0 and bucket.numel == 0.0
    assert Bucket(limit=10, reduce_s=lambda n: 100.0 + n).arrive([8, 8]) == (108.0,)  # no single_s: reduce_s


def test_one_layer_backward_walk_by_hand() -> None:
    """Bucket.layer_backward (the walk both the timeline and the quick estimate's share use), limit 25,
    reduce_s the elements: module 1 first (its `before` 4 joins the empty bucket, its weight 20 makes 24),
    then module 0, whose weight 10 overflows the 24 (flushed with its compute), then 1, 2, 3 join: 16 left.
    block_hooks gives gpt_grad_hooks only to a four-module layer with GPT_SMALL's eight small parameters."""
    bucket = Bucket(limit=25, reduce_s=lambda n: n)
    walk = bucket.layer_backward([(10.0, ((), (1.0,), (2.0, 3.0))), (20.0, ((4.0,), (), ()))])
    assert walk == [(1, ((), (), ())), (0, ((), (24.0,), ()))] and bucket.numel == 16.0
    assert block_hooks(NUMELS, SMALL) == gpt_grad_hooks(SMALL)
    assert block_hooks(NUMELS[:3], SMALL) is None and block_hooks(NUMELS, [H, H]) is None


def test_the_quick_estimate_share_is_the_elements_flushed_before_a_fetch() -> None:
    """Steady block by hand: it reduces 6 h, F h, F, h F, h^2 + 3 h and 3 h^2 (12 h^2 + 13 h elements), of
    which F h and h F (fc2's and fc1's weights, 8 h^2) flushed before a fetch. A block of other parameters
    (not the GPT layout): 0."""
    assert fetch_wait_share(NUMELS, SMALL, LIMIT) == pytest.approx(8 * H * H / (12 * H * H + 13 * H))
    assert fetch_wait_share(NUMELS, [H, H], LIMIT) == 0.0


def test_exact_and_quick_estimates_grow_with_the_exposed_buckets() -> None:
    """A small GPT under the 2021 engine with 1e6-element buckets (its weights 0.75-3 M elements, so a
    bucket per weight as at 530B), every ZeRO-3 candidate without pipeline: both models slower with the
    field on, the quick one (equal sub-modules, one share of the buckets exposed) by 0.82-1.43 x the exact
    one's growth on these four rows (measured since the quick estimate counts the sub-modules per block as the
    exact model does, cost.deepspeedrank.weight_numels; bound 0.75-1.50: the quick estimate's equal-share
    approximation, not a property of the mechanism), while the steps themselves agree within 3 %."""
    from autoplan.search.space import SearchOptions, enumerate_space

    graph = gpt_graph(h=512, a=8, layers=4, seq=512, vocab=4096)
    cluster = dataclasses.replace(a100_cluster(), dtype="fp16")
    space = enumerate_space(graph, cluster, SearchOptions(global_batch=16))
    rows = [i for i in range(len(space)) if space.config(i).zero == 3 and space.config(i).pp == 1
            and space.config(i).tp == 1][:4]
    assert rows
    on = dataclasses.replace(Engine.load("deepspeed"), zero3_reduce_bucket_numel=10**6)
    (q_on, e_on), (q_off, e_off) = (quick_and_exact(graph, cluster, space, rows, 16, eng)
                                    for eng in (on, dataclasses.replace(on, zero3_small_grad_hooks=False)))
    assert np.all(e_on > e_off) and np.all(q_on > q_off)
    ratio = (q_on - q_off) / (e_on - e_off)
    assert np.all((ratio > 0.75) & (ratio < 1.50)), ratio  # measured 0.818 .. 1.435 on these rows, margin 0.07
    assert np.all(np.abs(q_on / e_on - 1.0) < 0.03), q_on / e_on  # measured within 2.1 %
