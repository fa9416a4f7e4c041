"""Steady state of one lane under continuous batching with chunked prefill: TTFT, TPOT and throughput
from Little's law, a prefill queue and the interference of other requests' prefill chunks.

A lane (one instance, or one pipeline micro-batch of it) runs iterations of two kinds: decode-only
ones (time tau_d) and ones that also carry a prefill chunk of q = min(I, budget - B) tokens (tau_p),
the budget being the engine's max_num_batched_tokens (Agrawal et al., "Sarathi-Serve", OSDI'24:
chunked prefill; vLLM V1, SGLang and TensorRT-LLM schedule this way). A prompt needs k = ceil(I / q)
chunks. Per request:
- requests move at rate lambda (Little's law: N = lambda x time in system, Little 1961);
- a decoding request sees the other requests' prefill iterations at rate lambda_o k and decode
  iterations in the rest of the time, so TPOT = 1 / (lambda_o k + (1 - lambda_o k tau_p) / tau_d);
  without chunked prefill a prefill iteration pauses decoding: TPOT = tau_d / (1 - lambda_o k tau_p);
- closed loop (N clients): min(N, cap) are admitted (cap: the KV pool and the batch cap), the rest
  wait (N - c) / lambda; the other admitted clients' prompts arrive nearly independently, so a prompt
  waits for theirs as in an M/D/1 queue (below) at rate lambda (c - 1) / c; if prefill would need more
  than the whole lane, chunks pack to the budget and lambda is capped at what prefill can serve, the
  excess waiting for prefill;
- open loop (Poisson at rate lambda): the prefill chunks form an M/D/1 queue of utilisation
  rho = lambda k tau_p, waiting rho / (2 (1 - rho)) x k tau_p (Pollaczek-Khinchine); unstable when
  rho >= 1 or the requests in the system exceed cap.
An arrival also waits for the iteration under way: half an iteration when others are running.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from autoplan.serve.physics import Iteration

StepFn = Callable[[Iteration], float]
_ITERATIONS = 200
_TOLERANCE = 1e-9
_BISECTIONS = 24


@dataclass(frozen=True, slots=True, kw_only=True)
class LaneState:
    ttft_s: float
    tpot_s: float
    rate: float  # requests/s through the lane
    queue_s: float  # part of TTFT spent waiting (for a slot, the prefill queue, the running iteration)
    prefill_s: float  # the prompt's own chunks
    decode_batch: float  # requests in a decode iteration
    stable: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class LaneSpec:
    """The lane's workload and limits: prompt I, output O, capacity `cap` requests, chunk budget."""

    input_len: int
    output_len: int
    cap: float
    budget: int
    chunked: bool = True


def _iterations(step: StepFn, spec: LaneSpec, b_decode: float, b_prefill: float) -> tuple[float, float, int, float]:
    """(tau_d, tau_p, k, q) for decode batches b_decode (a decoding request's view) and b_prefill
    (decoders beside a prefill chunk)."""
    i, o = spec.input_len, spec.output_len
    room = max(spec.budget - b_prefill, 1.0) if spec.chunked else float(spec.budget)
    q = min(float(i), room)
    k = math.ceil(i / q)
    ctx = i + o / 2.0
    tau_d = step(Iteration(decode=b_decode, decode_context=ctx, sampled=b_decode))
    with_decode = b_prefill if spec.chunked else 0.0
    tau_p = step(Iteration(decode=with_decode, decode_context=ctx, prefill=q, prefill_context=i / 2.0,
                           sampled=with_decode + q / i))
    return tau_d, tau_p, k, q


def _tpot(rate_others: float, k: int, tau_p: float, tau_d: float, chunked: bool) -> float:
    busy = min(rate_others * k * tau_p, 1.0)
    if busy >= 1.0:
        return tau_p
    if chunked:
        return 1.0 / (rate_others * k + (1.0 - busy) / tau_d)
    return tau_d / (1.0 - busy)


def closed_loop(step: StepFn, spec: LaneSpec, users: float) -> LaneState:
    """Steady state of `users` clients in a closed loop on one lane (fixed point, damped)."""
    o = spec.output_len
    c = max(min(users, spec.cap), 1e-9)
    tpot = step(Iteration(decode=max(c, 1.0), decode_context=spec.input_len, sampled=max(c, 1.0)))
    t_pre = tpot
    rate, cycle = 0.0, 1.0
    for _ in range(_ITERATIONS):
        share = (o - 1) * tpot / (t_pre + (o - 1) * tpot)
        others = max(c - 1.0, 0.0)
        tau_d, tau_p, k, q = _iterations(step, spec, 1.0 + others * share, others * share)
        service = k * tau_p
        cycle = service + (o - 1) * tpot
        rate = c / cycle
        # the lane's prefill capacity, chunks packed to the budget (lambda I tau / room <= 1)
        cap_rate = q / (spec.input_len * tau_p)
        waited = 0.0
        if rate > cap_rate:
            rate = cap_rate
            waited = c / rate - cycle
        new_tpot = _tpot(rate * others / c, k, tau_p, tau_d, spec.chunked)
        new_pre = service + waited
        if abs(new_tpot - tpot) < _TOLERANCE * tpot and abs(new_pre - t_pre) < _TOLERANCE * max(t_pre, 1e-12):
            tpot, t_pre = new_tpot, new_pre
            break
        tpot, t_pre = 0.5 * (tpot + new_tpot), 0.5 * (t_pre + new_pre)
    residual = 0.5 * tau_d * min(others * share, 1.0)
    rate = c / (t_pre + (o - 1) * tpot)
    slot_wait = max(users - c, 0.0) / rate
    # the other clients' prompts arrive nearly independently: an M/D/1 wait for the prefill chunks
    prefill_wait = md1_wait_s(rate * others / c, service) if t_pre <= service else 0.0
    queue = slot_wait + (t_pre - service) + residual + (prefill_wait if math.isfinite(prefill_wait) else 0.0)
    return LaneState(ttft_s=service + queue, tpot_s=tpot, rate=rate, queue_s=queue, prefill_s=service,
                     decode_batch=1.0 + others * share)


def open_loop(step: StepFn, spec: LaneSpec, rate: float) -> LaneState:
    """Steady state of Poisson arrivals at `rate` requests/s on one lane; stable=False (TTFT infinite)
    when prefill or the KV/batch capacity cannot keep up."""
    o = spec.output_len
    tpot = step(Iteration(decode=1.0, decode_context=spec.input_len, sampled=1.0))
    service, tau_d, tau_p, k = tpot, tpot, tpot, 1
    for _ in range(_ITERATIONS):
        busy_decoders = rate * (o - 1) * tpot
        tau_d, tau_p, k, _ = _iterations(step, spec, 1.0 + busy_decoders, busy_decoders)
        service = k * tau_p
        new_tpot = _tpot(rate, k, tau_p, tau_d, spec.chunked)
        if abs(new_tpot - tpot) < _TOLERANCE * tpot:
            tpot = new_tpot
            break
        tpot = 0.5 * (tpot + new_tpot)
    rho = rate * k * tau_p
    in_system = rate * (service + (o - 1) * tpot)
    if rho >= 1.0 or in_system > spec.cap:
        served = min(spec.cap / (service + (o - 1) * tpot), 1.0 / (k * tau_p))
        return LaneState(ttft_s=math.inf, tpot_s=tpot, rate=served, queue_s=math.inf, prefill_s=service,
                         decode_batch=min(in_system, spec.cap), stable=False)
    wait = rho / (2.0 * (1.0 - rho)) * service + 0.5 * tau_d * min(rate * (o - 1) * tpot, 1.0)
    return LaneState(ttft_s=service + wait, tpot_s=tpot, rate=rate, queue_s=wait, prefill_s=service,
                     decode_batch=1.0 + rate * (o - 1) * tpot)


def md1_wait_s(rate: float, service_s: float) -> float:
    """Mean wait of an M/D/1 queue (Pollaczek-Khinchine with deterministic service): rho S / (2 (1 - rho))."""
    rho = rate * service_s
    if rho >= 1.0:
        return math.inf
    return rho * service_s / (2.0 * (1.0 - rho))


def front_stage_closed(lm_rate: Callable[[float], float], users: float, *, service_s: float, handoff_s: float,
                       servers: int) -> tuple[float, float]:
    """A closed loop of `users` clients through a front stage (an encoder group of `servers` M/D/1
    instances of service S, then a hand-off H) and the language model: (clients inside the language model
    u, the front stage's wait W). Little's law on the front stage: N = u + lambda(u) (W + S + H), with
    lambda(u) the language model's request rate at u clients and W the M/D/1 wait at lambda (N - 1) / N
    (a client never queues behind its own request); bisection on u, which lambda grows with. At the
    encoder's capacity (lambda S = servers) the clients left over wait there: W = (N - u) / lambda - S - H."""
    others = max(users - 1.0, 0.0) / users

    def wait(rate: float) -> float:
        return md1_wait_s(rate * others / servers, service_s)

    def excess(u: float) -> float:
        rate = lm_rate(u)
        if rate * service_s >= servers:
            return math.inf
        return u + rate * (wait(rate) + service_s + handoff_s) - users

    lo, hi = 0.0, users
    for _ in range(_BISECTIONS):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if excess(mid) < 0 else (lo, mid)
    u = max(lo, 1e-9)
    rate = lm_rate(u)
    if lm_rate(hi) * service_s < servers or rate <= 0:
        return u, wait(rate)
    # at the encoder's capacity the M/D/1 wait stays finite for N - 1 others: the clients left over wait
    return u, max(wait(rate), (users - u) / rate - service_s - handoff_s)

