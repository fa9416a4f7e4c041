"""One serving configuration's estimate: memory first (does it fit, how many requests the KV pool
holds), then the steady state of its lanes (queueing.py) under the iteration times of physics.py.

Aggregated: replicas x pp lanes share the load evenly; each lane prefills and decodes (chunked).
Disaggregated: prefill lanes (no decode interference) serve prompts as M/D/1 queues, hand the KV cache
over the link between the groups (physics.kv_transfer_s), and decode lanes run decode-only iterations.
A model with an encoder (encoder.py) prefills input_len + images x its tokens. Co-located, each prefill
token also carries its share of the request's encoder pass (encode_s / prompt tokens: the instance's
mean work is exact; a chunk holding the images pays all of it in vLLM, which moves no mean); with an
encoder group of its own, requests first queue there (M/D/1 per instance; queueing.front_stage_closed
for closed loops), then hand their image features to the prefill instance.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from autoplan.cluster.types import ClusterSpec
from autoplan.serve.encoder import check_encoder_tp, encode_parts, encoder_memory, handoff_s
from autoplan.serve.memory import InstanceMemory, check_layout, instance_memory
from autoplan.serve.physics import Hardware, Iteration, kv_transfer_s, lane_step_s
from autoplan.serve.queueing import (
    LaneSpec,
    LaneState,
    closed_loop,
    front_stage_closed,
    md1_wait_s,
    open_loop,
)
from autoplan.serve.simulate import simulate_closed, simulate_open
from autoplan.serve.types import ServeConfig, ServeEstimate, ServeModel, Workload

_ITERATIONS = 200
_BISECTIONS = 40


class _Instance:
    """One instance layout with its memory and a memoised iteration-time function; `encode_per_token`
    is the co-located encoder's seconds per prefill token."""

    def __init__(self, *, tp: int, pp: int, ep: int, memory: InstanceMemory, hw: Hardware,
                 model: ServeModel, encode_per_token: float = 0.0) -> None:
        self.tp, self.pp, self.ep, self.memory, self.hw, self.model = tp, pp, ep, memory, hw, model
        self.encode_per_token = encode_per_token
        self._cache: dict[Iteration, float] = {}

    def step(self, it: Iteration) -> float:
        value = self._cache.get(it)
        if value is None:
            value = lane_step_s(self.model, it, tp=self.tp, pp=self.pp, ep=self.ep, hw=self.hw)[0]
            value += it.prefill * self.encode_per_token
            self._cache[it] = value
        return value

    def parts(self, it: Iteration) -> dict[str, float]:
        parts = lane_step_s(self.model, it, tp=self.tp, pp=self.pp, ep=self.ep, hw=self.hw)[1]
        if it.prefill and self.encode_per_token:
            parts["encode"] = it.prefill * self.encode_per_token
        return parts


def _instance(model: ServeModel, hw: Hardware, tp: int, pp: int, ep: int, *, encode_per_token: float = 0.0,
              extra_weights: float = 0.0) -> _Instance:
    check_layout(model, tp, pp)
    for group in model.blocks:
        if group.num_experts and group.num_experts % ep:
            raise ValueError(f"ep={ep} does not divide the {group.num_experts} experts of {model.name}")
    dev = hw.cluster.device
    seqs, budget = hw.engine.batch_defaults(dev.name, dev.mem_bytes)
    memory = instance_memory(model, dev, hw.engine, tp=tp, pp=pp, batched_tokens=budget, max_seqs=seqs,
                             extra_weights=extra_weights)
    return _Instance(tp=tp, pp=pp, ep=ep, memory=memory, hw=hw, model=model, encode_per_token=encode_per_token)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Encode:
    """The encode stage of one config: a request's encoder pass, its hand-off, where it runs."""

    encode_s: float = 0.0
    handoff_s: float = 0.0
    servers: int = 0  # encoder instances of its own (0: co-located with the prefill instances)
    colocated_weights: float = 0.0  # encoder bytes per device of each prefill instance when co-located
    fits: bool = True
    note: str = ""


def _encode_stage(model: ServeModel, hw: Hardware, config: ServeConfig, workload: Workload) -> _Encode:
    enc, images = model.encoder, workload.images_per_request
    if enc is None or images == 0:
        if config.encoder_replicas:
            raise ValueError(f"encoder_replicas={config.encoder_replicas}: {model.name} has no encoder to serve "
                             f"(or images_per_request is 0)")
        return _Encode()
    act = model.act_bytes
    if not config.encoder_replicas:
        tp = config.prefill_tp
        check_encoder_tp(enc, tp)
        return _Encode(encode_s=sum(encode_parts(enc, images, tp=tp, act_bytes=act, hw=hw).values()),
                       colocated_weights=enc.params * act / tp)
    tp = config.encoder_tp
    check_encoder_tp(enc, tp)
    weights, budget = encoder_memory(enc, tp=tp, act_bytes=act, hw=hw)
    crosses = config.num_devices > hw.cluster.devices_per_node
    return _Encode(encode_s=sum(encode_parts(enc, images, tp=tp, act_bytes=act, hw=hw).values()),
                   handoff_s=handoff_s(enc, images, crosses_nodes=crosses, hw=hw), servers=config.encoder_replicas,
                   fits=weights <= budget,
                   note="" if weights <= budget else f"the encoder's weights take {weights / 2**30:.1f} GiB per "
                   f"device of its tp={tp} instance, over the engine's {budget / 2**30:.1f} GiB")


def prompt_workload(model: ServeModel, workload: Workload) -> Workload:
    """The workload the language model sees: input_len + images x the tokens each image fills."""
    if model.encoder is None or not workload.images_per_request:
        return workload
    extra = workload.images_per_request * model.encoder.output_tokens
    return dataclasses.replace(workload, input_len=workload.input_len + extra)


def _check_devices(config: ServeConfig, cluster: ClusterSpec) -> None:
    for name, tp in (("tp", config.tp), ("prefill_tp", config.prefill_tp)):
        if tp > cluster.devices_per_node:
            raise ValueError(f"{name}={tp} is larger than a node of {cluster.devices_per_node} devices: "
                             f"tensor parallelism stays inside a node")
    if config.num_devices > cluster.num_devices:
        raise ValueError(f"the config uses {config.num_devices} devices but the cluster has {cluster.num_devices}: "
                         f"use fewer replicas or a smaller tp / pp")


def estimate_serving(model: ServeModel, hw: Hardware, config: ServeConfig, workload: Workload) -> ServeEstimate:
    """The predicted TTFT, TPOT, throughput and memory of `config` serving `workload`."""
    _check_devices(config, hw.cluster)
    enc = _encode_stage(model, hw, config, workload)
    workload = prompt_workload(model, workload)
    per_token = enc.encode_s / workload.input_len if not enc.servers else 0.0
    at_prefill = {"encode_per_token": per_token, "extra_weights": enc.colocated_weights}
    decode = _instance(model, hw, config.tp, config.pp, config.ep, **({} if config.disaggregated else at_prefill))
    tokens_each = workload.input_len + workload.output_len
    per_instance = min(config.max_batch, decode.memory.requests(tokens_each))
    fits = per_instance >= 1
    notes: list[str] = [enc.note] if enc.note else []
    prefill = None
    if config.disaggregated:
        prefill = _instance(model, hw, config.prefill_tp, config.prefill_pp, config.ep, **at_prefill)
        if prefill.memory.requests(workload.input_len + 1) < 1:
            fits = False
            notes.append(f"the prefill instance (tp={config.prefill_tp}, pp={config.prefill_pp}) cannot hold one prompt")
    if not fits or not enc.fits:
        if not fits:
            notes.append(f"weights take {decode.memory.weights / 2**30:.1f} GiB per device of "
                         f"{decode.memory.capacity / 2**30:.1f} GiB: no room for the KV cache of one request")
        return _unfit(decode, config, notes)
    lane_cap = per_instance / config.pp

    def lm(users: float | None) -> tuple[LaneState, float]:
        if config.disaggregated:
            assert prefill is not None
            return _disaggregated(decode, prefill, config, workload, lane_cap, users)
        spec = _lane_spec(decode, workload, lane_cap, chunked=hw.engine.chunked_prefill)
        return _aggregated(decode, spec, config.replicas * config.pp, workload, users), 0.0

    state, transfer, wait = _with_encoder(lm, enc, config, workload)
    est = _assemble(decode, config, workload, state, transfer, per_instance, notes)
    return dataclasses.replace(est, encode_s=enc.encode_s, encoder_handoff_s=enc.handoff_s, encode_queue_s=wait)


def _with_encoder(lm, enc: _Encode, config: ServeConfig, workload: Workload) -> tuple[LaneState, float, float]:
    """(the language model's lane state, its KV transfer, the encoder wait): with an encoder group of its
    own in front, its M/D/1 wait, the encoder pass and the hand-off are added to TTFT (closed loops:
    queueing.front_stage_closed)."""
    if not enc.servers:
        return (*lm(None), 0.0)
    lanes = config.replicas * config.pp
    front = enc.encode_s + enc.handoff_s
    if workload.concurrency is None:
        assert workload.rate is not None
        state, transfer = lm(None)
        wait = md1_wait_s(workload.rate / enc.servers, enc.encode_s)
        stable = state.stable and math.isfinite(wait)
        return dataclasses.replace(state, ttft_s=state.ttft_s + wait + front, queue_s=state.queue_s + wait,
                                   stable=stable), transfer, wait
    users, wait = front_stage_closed(lambda u: lm(u)[0].rate * lanes, float(workload.concurrency),
                                     service_s=enc.encode_s, handoff_s=enc.handoff_s, servers=enc.servers)
    state, transfer = lm(users)
    return dataclasses.replace(state, ttft_s=state.ttft_s + wait + front, queue_s=state.queue_s + wait), transfer, wait


def _lane_spec(inst: _Instance, workload: Workload, cap: float, *, chunked: bool) -> LaneSpec:
    _, budget = inst.hw.engine.batch_defaults(inst.hw.cluster.device.name, inst.hw.cluster.device.mem_bytes)
    return LaneSpec(input_len=workload.input_len, output_len=workload.output_len, cap=cap, budget=budget,
                    chunked=chunked)


def _aggregated(inst: _Instance, spec: LaneSpec, lanes: int, workload: Workload, users: float | None = None) -> LaneState:
    """One lane's steady state: Little's law and M/D/1 (queueing.py), or the discrete-event
    simulation (simulate.py) for bursty arrivals or when asked; lanes split the load evenly. `users`
    replaces the workload's concurrency (the clients an encoder group in front leaves to the lanes)."""
    if workload.concurrency is not None:
        users = workload.concurrency if users is None else users
        if workload.simulated:
            return simulate_closed(inst.step, spec, max(round(users / lanes), 1))
        return closed_loop(inst.step, spec, users / lanes)
    assert workload.rate is not None
    if workload.simulated:
        return simulate_open(inst.step, spec, workload.rate / lanes, burstiness=workload.burstiness)
    return open_loop(inst.step, spec, workload.rate / lanes)


def _disaggregated(decode: _Instance, prefill: _Instance, config: ServeConfig, workload: Workload,
                   lane_cap: float, users: float | None = None) -> tuple[LaneState, float]:
    """Prefill lanes as M/D/1 servers of S = one prompt's prefill, the KV hand-off, decode lanes of
    decode-only iterations; closed loop by a damped fixed point on the request rate."""
    i, o = workload.input_len, workload.output_len
    service = prefill.step(Iteration(prefill=i, prefill_context=i / 2.0, sampled=1.0))
    crosses = config.num_devices > decode.hw.cluster.devices_per_node
    transfer = kv_transfer_s(decode.model, i, sender=(config.prefill_tp, config.prefill_pp),
                             receiver=(config.tp, config.pp), crosses_nodes=crosses, hw=decode.hw)
    p_lanes, d_lanes = config.prefill_replicas * config.prefill_pp, config.replicas * config.pp
    ctx = i + o / 2.0

    def tpot_at(batch: float) -> float:
        return decode.step(Iteration(decode=batch, decode_context=ctx, sampled=batch))

    prefill_cap = p_lanes / service
    decode_cap = d_lanes * lane_cap / ((o - 1) * tpot_at(lane_cap)) if o > 1 else math.inf
    capacity = min(prefill_cap, decode_cap)
    if workload.rate is not None:
        rate = workload.rate
        batch = max(rate / d_lanes * (o - 1) * tpot_at(1.0), 1.0)
        for _ in range(_ITERATIONS):
            batch = 0.5 * (batch + max(rate / d_lanes * (o - 1) * tpot_at(batch), 1.0))
        tpot = tpot_at(batch)
        stable = rate < capacity and batch <= lane_cap
        wait = md1_wait_s(rate / p_lanes, service) if stable else math.inf
        served = rate if stable else capacity
        return LaneState(ttft_s=wait + service + transfer, tpot_s=tpot, rate=served / d_lanes, queue_s=wait,
                         prefill_s=service, decode_batch=batch, stable=stable), transfer
    users = float(workload.concurrency or 1) if users is None else users
    return _disaggregated_closed(users, tpot_at, service=service, transfer=transfer,
                                 p_lanes=p_lanes, d_lanes=d_lanes, lane_cap=lane_cap, output_len=o), transfer


def _disaggregated_closed(users: float, tpot_at, *, service: float, transfer: float, p_lanes: int, d_lanes: int,
                          lane_cap: float, output_len: int) -> LaneState:
    """Closed loop over prefill (M/D/1 lanes fed by the other N - 1 clients), hand-off and decode:
    bisection on the decode batch b per lane, where Little's law on the decode phase gives the rate
    lambda(b) = b D / ((O - 1) TPOT(b)) and on the whole cycle N = lambda (wait + S + transfer) + b D.
    If even b = cap leaves users over, the decode lanes are full and the rest wait for a slot."""
    o = max(output_len - 1, 1)
    others = max(users - 1.0, 0.0) / users  # a client never queues behind its own prompt

    def rate_of(b: float) -> float:
        return b * d_lanes / (o * tpot_at(b))

    def excess(b: float) -> float:
        rate = rate_of(b)
        if rate * service >= p_lanes:
            return math.inf
        wait = md1_wait_s(rate * others / p_lanes, service)
        return rate * (wait + service + transfer) + b * d_lanes - users

    lo, hi = 1e-6, lane_cap
    if excess(hi) <= 0:
        rate = rate_of(hi)
        wait = users / rate - (service + transfer + o * tpot_at(hi))
        return LaneState(ttft_s=wait + service + transfer, tpot_s=tpot_at(hi), rate=rate / d_lanes, queue_s=wait,
                         prefill_s=service, decode_batch=hi)
    for _ in range(_BISECTIONS):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if excess(mid) < 0 else (lo, mid)
    b = max(lo, 1.0)
    rate = rate_of(lo)
    wait = md1_wait_s(rate * others / p_lanes, service)
    return LaneState(ttft_s=wait + service + transfer, tpot_s=tpot_at(b), rate=rate / d_lanes, queue_s=wait,
                     prefill_s=service, decode_batch=b)


def _assemble(inst: _Instance, config: ServeConfig, workload: Workload, state: LaneState, transfer: float,
              per_instance: int, notes: list[str]) -> ServeEstimate:
    lanes = config.replicas * config.pp
    o = workload.output_len
    tokens_per_s = state.rate * lanes * o
    resident = min(state.decode_batch * config.pp, per_instance)
    tokens_each = workload.input_len + workload.output_len
    ctx = workload.input_len + o / 2.0
    parts = inst.parts(Iteration(decode=state.decode_batch, decode_context=ctx, sampled=state.decode_batch))
    if not state.stable:
        notes.append("the arrival rate exceeds what this plan serves: the queue (and TTFT) grows without bound")
    return ServeEstimate(
        ttft_s=state.ttft_s, tpot_s=state.tpot_s, tokens_per_s=tokens_per_s,
        tokens_per_s_per_gpu=tokens_per_s / config.num_devices,
        kv_cache_bytes_per_gpu=inst.memory.kv_pool, max_concurrency=per_instance * config.replicas,
        peak_mem_bytes=inst.memory.used(math.ceil(resident) * tokens_each), fits=True,
        mem_capacity_bytes=inst.memory.capacity, weight_bytes_per_gpu=inst.memory.weights,
        e2e_latency_s=state.ttft_s + (o - 1) * state.tpot_s, request_rate=state.rate * lanes,
        tokens_per_s_per_user=1.0 / state.tpot_s if state.tpot_s > 0 else 0.0, kv_transfer_s=transfer,
        queue_s=state.queue_s, stable=state.stable, breakdown=tuple(sorted(parts.items())), notes=tuple(notes))


def _unfit(inst: _Instance, config: ServeConfig, notes: list[str]) -> ServeEstimate:
    return ServeEstimate(ttft_s=math.inf, tpot_s=math.inf, tokens_per_s=0.0, tokens_per_s_per_gpu=0.0,
                         kv_cache_bytes_per_gpu=inst.memory.kv_pool, max_concurrency=0,
                         peak_mem_bytes=inst.memory.weights + inst.memory.activations + inst.memory.workspace,
                         fits=False, mem_capacity_bytes=inst.memory.capacity,
                         weight_bytes_per_gpu=inst.memory.weights, stable=False, notes=tuple(notes))


def static_batch(model: ServeModel, hw: Hardware, *, tp: int, pp: int = 1, ep: int = 1, batch: int,
                 input_len: int, output_len: int) -> tuple[float, float, float]:
    """(TTFT, TPOT, end-to-end latency) of a lockstep batch, what vLLM's benchmark_latency and
    TensorRT-LLM's gptSessionBenchmark measure: `batch` prompts prefilled in one pass, then
    output_len - 1 decode steps of the whole batch at the mean context input_len + output_len / 2."""
    inst = _instance(model, hw, tp, pp, ep)
    ttft = inst.step(Iteration(prefill=batch * input_len, prefill_context=input_len / 2.0, sampled=batch))
    tpot = inst.step(Iteration(decode=batch, decode_context=input_len + output_len / 2.0, sampled=batch))
    return ttft, tpot, ttft + (output_len - 1) * tpot
