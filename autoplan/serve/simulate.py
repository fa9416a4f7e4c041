"""A small discrete-event simulation of one lane under continuous batching, for arrivals that Little's
law and the M/D/1 queue of queueing.py describe poorly: bursty open-loop traffic and queues near
saturation.

Arrivals: open loop with gamma-distributed gaps of shape k = burstiness and scale 1 / (rate k) (mean
1 / rate; k = 1 is Poisson, k < 1 burstier, k -> inf evenly spaced), exactly as vLLM's
benchmarks/benchmark_serving.py get_request (`np.random.gamma(shape=burstiness, scale=theta)`,
theta = 1 / (request_rate * burstiness)); or a closed loop of `users` clients that all start at t = 0
and send the next request when the last one finishes (genai-perf --concurrency, vLLM
--max-concurrency).

Scheduler (vLLM V1 / Sarathi-Serve chunked prefill, FCFS): each iteration runs one decode token for
every running request, then fills the rest of the token budget (max_num_batched_tokens) with prompt
chunks of admitted requests in arrival order; a request is admitted while fewer than `cap` are in
the lane (KV pool and batch cap). Without chunked prefill an iteration with prompts runs them alone
(budget-limited whole prompts) and decodes pause. An iteration takes step(Iteration(...)) seconds (the
physics of physics.py); arrivals join the queue at once and are scheduled at the next iteration start.
Runs of decode-only iterations with no arrival or completion in between are advanced together, so the
cost is per event, not per token.

Metrics (the definitions of types.py): TTFT = the end of the iteration that finishes a request's prompt
(its first token) - its arrival; TPOT = (finish - first token) / (output_len - 1); both averaged over
the requests that arrive in the middle 60 % of the run (the first 20 % warm the queue up, the last 20 %
drain it). The run is unstable when the backlog (requests waiting or prefilling) still grows at
the last arrival (over 50 and 1.5 times as many as at mid-run: a queue that grows linearly has twice as many).
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field

from autoplan.serve.physics import Iteration
from autoplan.serve.queueing import LaneSpec, LaneState, StepFn

_CONTEXT_QUANTUM = 32  # tokens: contexts are rounded for the memoised step function
_WARM, _COOL = 0.2, 0.8


@dataclass(slots=True)
class _Request:
    arrival: float
    prompt_left: int
    first_token: float = math.nan
    finish: float = math.nan
    decoded: int = 0  # output tokens produced (the first comes from the prefill)
    admitted: float = math.nan


@dataclass(slots=True)
class _Lane:
    spec: LaneSpec
    step: StepFn
    now: float = 0.0
    waiting: deque = field(default_factory=deque)  # arrived, not admitted
    prefilling: deque = field(default_factory=deque)  # admitted, prompt not done
    running: list = field(default_factory=list)  # decoding
    done: list = field(default_factory=list)
    batch_samples: list = field(default_factory=list)

    @property
    def admitted(self) -> int:
        return len(self.prefilling) + len(self.running)

    def admit(self) -> None:
        while self.waiting and self.admitted < self.spec.cap:
            request = self.waiting.popleft()
            request.admitted = self.now
            self.prefilling.append(request)


def gamma_gaps(rate: float, burstiness: float, count: int, seed: int = 0) -> list[float]:
    """`count` inter-arrival gaps with mean 1 / rate: gamma(shape=burstiness, scale=1 / (rate burstiness))."""
    if not rate > 0 or not burstiness > 0:
        raise ValueError(f"rate and burstiness must be positive, got rate={rate!r}, burstiness={burstiness!r}")
    rng = random.Random(seed)
    if math.isinf(burstiness):
        return [1.0 / rate] * count
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(count)]


def _quantize(x: float) -> float:
    return float(max(_CONTEXT_QUANTUM, round(x / _CONTEXT_QUANTUM) * _CONTEXT_QUANTUM))


def _decode_iteration(lane: _Lane, steps: int) -> tuple[Iteration, float]:
    """The Iteration of the running batch midway through `steps` decode-only iterations."""
    b = len(lane.running)
    i = lane.spec.input_len
    ctx = sum(i + r.decoded for r in lane.running) / b + (steps - 1) / 2.0
    return Iteration(decode=float(b), decode_context=_quantize(ctx), sampled=float(b)), float(b)


def _mixed_iteration(lane: _Lane) -> tuple[Iteration, list[_Request]]:
    """Decodes plus prompt chunks up to the budget; returns the Iteration and the prompts it finishes."""
    spec = lane.spec
    b = len(lane.running) if spec.chunked else 0
    room = max(spec.budget - b, 1)
    chunk, finished, ctx_weighted = 0, [], 0.0
    for r in lane.prefilling:
        if room <= 0 or (not spec.chunked and r.prompt_left > room and chunk):
            break
        take = min(r.prompt_left, room)
        done_before = spec.input_len - r.prompt_left
        ctx_weighted += take * (done_before + take / 2.0)
        r.prompt_left -= take
        chunk += take
        room -= take
        if r.prompt_left == 0:
            finished.append(r)
    ctx = lane.running and b and sum(spec.input_len + r.decoded for r in lane.running) / len(lane.running)
    it = Iteration(decode=float(b), decode_context=_quantize(ctx or 1.0), prefill=float(chunk),
                   prefill_context=_quantize(ctx_weighted / chunk), sampled=float(b + len(finished)))
    return it, finished


def _advance_decodes(lane: _Lane, steps: int, duration: float) -> None:
    """`steps` decode tokens for every running request over `duration` seconds; retire the finished."""
    o = lane.spec.output_len
    still = []
    for r in lane.running:
        r.decoded += steps
        if r.decoded >= o:
            r.finish = lane.now + duration * (o - (r.decoded - steps)) / steps
            lane.done.append(r)
        else:
            still.append(r)
    lane.running = still


def _run_iteration(lane: _Lane, next_arrival: float) -> None:
    """One scheduler step: a mixed iteration if prompts are pending, else a run of decode iterations."""
    lane.admit()
    if lane.prefilling:
        it, finished = _mixed_iteration(lane)
        duration = lane.step(it)
        if it.decode:
            _advance_decodes(lane, 1, duration)
        lane.now += duration
        for r in finished:
            lane.prefilling.remove(r)
            r.first_token, r.decoded = lane.now, 1
            (lane.done if r.decoded >= lane.spec.output_len else lane.running).append(r)
            if r.decoded >= lane.spec.output_len:
                r.finish = lane.now
        lane.batch_samples.append((duration, it.decode))
        return
    o = lane.spec.output_len
    steps = min(o - r.decoded for r in lane.running)
    it, b = _decode_iteration(lane, 1)
    tau = lane.step(it)
    if math.isfinite(next_arrival) and next_arrival > lane.now:
        steps = max(1, min(steps, math.ceil((next_arrival - lane.now) / tau)))
    elif math.isfinite(next_arrival):
        steps = 1
    it, b = _decode_iteration(lane, steps)
    duration = steps * lane.step(it)
    _advance_decodes(lane, steps, duration)
    lane.now += duration
    lane.batch_samples.append((duration, b))


_MAX_EVENTS = 400_000
_GROWING, _BACKLOG = 1.5, 50  # unstable: the backlog at the last arrival is 1.5x that at mid-run and over 50


def simulate_open(step: StepFn, spec: LaneSpec, rate: float, *, burstiness: float = 1.0,
                  num_requests: int = 800, seed: int = 0) -> LaneState:
    """Open-loop arrivals at `rate` requests/s with gamma gaps of shape `burstiness` on one lane."""
    gaps = gamma_gaps(rate, burstiness, num_requests, seed)
    arrivals, t = [], 0.0
    for gap in gaps:
        arrivals.append(t)
        t += gap
    lane = _Lane(spec=spec, step=step)
    k, mid_queue, end_queue = 0, 0, 0
    for _ in range(_MAX_EVENTS):
        if len(lane.done) >= num_requests:
            break
        while k < num_requests and arrivals[k] <= lane.now:
            lane.waiting.append(_Request(arrival=arrivals[k], prompt_left=spec.input_len))
            k += 1
            if k == num_requests // 2:
                mid_queue = len(lane.waiting) + len(lane.prefilling)
            if k == num_requests:
                end_queue = len(lane.waiting) + len(lane.prefilling)
        if not (lane.waiting or lane.prefilling or lane.running):
            lane.now = arrivals[k]
            continue
        _run_iteration(lane, arrivals[k] if k < num_requests else math.inf)
    growing = end_queue > _GROWING * mid_queue and end_queue > _BACKLOG
    stable = not growing and len(lane.done) >= num_requests
    return _summary(lane, stable=stable)


def simulate_closed(step: StepFn, spec: LaneSpec, users: int, *, num_requests: int = 0) -> LaneState:
    """`users` clients in a closed loop on one lane, all starting at t = 0 (at least 5 rounds)."""
    total = max(num_requests, 5 * users, 200)
    lane = _Lane(spec=spec, step=step)
    lane.waiting.extend(_Request(arrival=0.0, prompt_left=spec.input_len) for _ in range(users))
    issued, retired = users, 0
    for _ in range(_MAX_EVENTS):
        if len(lane.done) >= total:
            break
        _run_iteration(lane, math.inf)
        for r in lane.done[retired:]:
            if issued < total:
                lane.waiting.append(_Request(arrival=r.finish, prompt_left=spec.input_len))
                issued += 1
        retired = len(lane.done)
    return _summary(lane, stable=len(lane.done) >= total)


def _summary(lane: _Lane, *, stable: bool) -> LaneState:
    """Means over the requests that arrived in the middle of the run (see the module docstring)."""
    done = sorted(lane.done, key=lambda r: r.arrival)
    if not done:
        return LaneState(ttft_s=math.inf, tpot_s=math.inf, rate=0.0, queue_s=math.inf, prefill_s=math.inf,
                         decode_batch=0.0, stable=False)
    lo, hi = int(_WARM * len(done)), max(int(_COOL * len(done)), int(_WARM * len(done)) + 1)
    window = done[lo:hi]
    o = lane.spec.output_len
    ttft = sum(r.first_token - r.arrival for r in window) / len(window)
    tpot = sum((r.finish - r.first_token) / (o - 1) for r in window) / len(window) if o > 1 else 0.0
    queue = sum(r.admitted - r.arrival for r in window) / len(window)
    span = max(r.finish for r in window) - min(r.arrival for r in window)
    busy = sum(d for d, _ in lane.batch_samples)
    batch = sum(d * b for d, b in lane.batch_samples) / busy if busy > 0 else 0.0
    if not stable:
        ttft = queue = math.inf
    return LaneState(ttft_s=ttft, tpot_s=tpot, rate=len(window) / span if span > 0 else 0.0, queue_s=queue,
                     prefill_s=ttft - queue, decode_batch=max(batch, 1.0), stable=stable)
