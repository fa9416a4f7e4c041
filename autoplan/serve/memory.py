"""Memory of a serving instance per device: weights, the paged KV cache, the engine's reserve and the
activation workspace, and from them how many tokens and requests the KV pool holds.

KV bytes per token (Kwon et al., "Efficient Memory Management for Large Language Model Serving with
PagedAttention", SOSP'23, section 2): 2 (K and V) x layers x kv_heads x head_dim x bytes. Under tensor
parallelism each rank keeps kv_heads / tp heads; once tp exceeds kv_heads every rank keeps one head,
replicated tp / kv_heads times (vLLM QKVParallelLinear.num_kv_head_replicas), so capacity per device
stops growing. The pool is allocated in blocks of the engine's kv_block_tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autoplan.cluster.types import DeviceSpec
from autoplan.serve.types import ServeEngine, ServeModel

# Logits of the sampler's profiling pass are fp32, and the softmax keeps a second fp32 copy
# (vLLM gpu_model_runner._dummy_sampler_run samples max_num_seqs dummy rows of the full vocabulary).
_LOGIT_BYTES = 4.0
_LOGIT_COPIES = 2


def kv_heads_per_rank(g: int, tp: int) -> int:
    """kv heads one tp rank holds: g / tp, or 1 (replicated) once tp >= g."""
    if tp >= g:
        return 1
    if g % tp:
        raise ValueError(f"tp={tp} does not divide num_kv_heads={g}: vLLM and SGLang need one to divide the other")
    return g // tp


def check_layout(model: ServeModel, tp: int, pp: int) -> None:
    """One clear line when heads or layers do not split over tp / pp."""
    for group in model.blocks:
        if group.a % tp:
            raise ValueError(f"tp={tp} does not divide {model.name}'s num_heads={group.a}: choose a tp that divides it")
        if tp > group.g and tp % group.g:
            raise ValueError(f"tp={tp} is neither a divisor nor a multiple of num_kv_heads={group.g}")
        kv_heads_per_rank(group.g, tp)
    if pp > model.num_layers:
        raise ValueError(f"pp={pp} exceeds the {model.num_layers} layers of {model.name}")


def stage_layers(count: int, pp: int) -> int:
    """Blocks of a group on the heaviest pipeline stage (an even split, rounded up)."""
    return math.ceil(count / pp)


def weight_bytes_per_gpu(model: ServeModel, tp: int, pp: int) -> float:
    """Weights on the heaviest device: ceil(L / pp) blocks split over tp (dense and routed experts
    alike: ep shards experts inside the tp group, tp / ep shards each expert), plus the vocab-parallel
    embedding and LM head over tp (vLLM VocabParallelEmbedding / ParallelLMHead), both on one stage
    when pp = 1, else the larger on its end stage."""
    blocks = sum(stage_layers(b.count, pp) * (b.dense_params + b.expert_params) for b in model.blocks)
    ends = model.embed_params + model.head_params if pp == 1 else max(model.embed_params, model.head_params)
    return (blocks * model.weight_bytes + ends * model.ends_weight_bytes) / tp


def kv_bytes_per_token_per_gpu(model: ServeModel, tp: int, pp: int) -> float:
    """K and V of one token on one device of the heaviest stage: 2 x ceil(L/pp) x kv_heads_per_rank x d x bytes."""
    elements = sum(stage_layers(b.count, pp) * kv_heads_per_rank(b.g, tp) * b.d for b in model.blocks)
    return 2.0 * elements * model.kv_bytes


def activation_bytes(model: ServeModel, tp: int, tokens: int, seqs: int) -> float:
    """Peak activations of the engine's profiling pass: `tokens` (max_num_batched_tokens) through the
    widest block, live at once: the residual and the normed input (2 h), the larger of the QKV + attention
    output ((a + 2g) d / tp + a d / tp) and the MLP's up projections with the activation (n_mlp f / tp),
    in the activation dtype; plus the sampler's fp32 logits for `seqs` sequences (x2 with the softmax)."""
    widest = 0.0
    for b in model.blocks:
        attn = ((b.a + 2 * b.g) * b.d + b.a * b.d) / tp
        mlp = b.n_mlp * b.f / tp
        widest = max(widest, 2 * b.h + max(attn, mlp))
    return tokens * widest * model.act_bytes + seqs * model.vocab_size * _LOGIT_BYTES * _LOGIT_COPIES


@dataclass(frozen=True, slots=True, kw_only=True)
class InstanceMemory:
    """Per-device memory of one instance, bytes, and the KV pool's capacity in tokens."""

    weights: float
    activations: float
    workspace: float
    kv_pool: float
    kv_per_token: float
    capacity: float  # device memory
    block_tokens: int

    @property
    def kv_tokens(self) -> int:
        """Tokens the pool holds per instance, in whole blocks (each device holds its share of every token)."""
        if self.kv_pool <= 0 or self.kv_per_token <= 0:
            return 0
        blocks = int(self.kv_pool // (self.kv_per_token * self.block_tokens))
        return blocks * self.block_tokens

    def requests(self, tokens_per_request: int) -> int:
        """Requests of `tokens_per_request` tokens the pool holds at once (each rounded up to blocks)."""
        blocks_each = math.ceil(tokens_per_request / self.block_tokens)
        return self.kv_tokens // (blocks_each * self.block_tokens)

    def used(self, tokens: float) -> float:
        """Weights, activations, workspace and the KV of `tokens` cached tokens."""
        return self.weights + self.activations + self.workspace + min(tokens, self.kv_tokens) * self.kv_per_token


def engine_reserve_fraction(engine: ServeEngine, device: DeviceSpec, tp: int, pp: int) -> float:
    """The engine's static memory fraction: SGLang's (mem - reserved) / mem with reserved from its
    device-memory bucket (server_args.py, _handle_gpu_memory_settings), else memory_fraction."""
    for max_mem, base, per_rank in engine.reserve_buckets:
        if device.mem_bytes < max_mem:
            reserved = base + per_rank * tp * pp
            return max(0.0, (device.mem_bytes - reserved) / device.mem_bytes)
    return engine.memory_fraction


def instance_memory(model: ServeModel, device: DeviceSpec, engine: ServeEngine, *, tp: int, pp: int,
                    batched_tokens: int, max_seqs: int, extra_weights: float = 0.0) -> InstanceMemory:
    """The KV pool left on each device after the engine's budget takes weights and activations:
    - "total" (vLLM gpu_memory_utilization): pool = f * mem - weights - activations - workspace;
      with reserve buckets (SGLang mem_fraction_static) activations live in the reserve: pool =
      f * mem - weights - workspace;
    - "free" (TensorRT-LLM free_gpu_memory_fraction): pool = f * (mem - weights - activations - workspace).
    extra_weights: bytes per device of other weights the instance holds (an encoder run with it)."""
    weights = weight_bytes_per_gpu(model, tp, pp) + extra_weights
    acts = activation_bytes(model, tp, batched_tokens, max_seqs)
    work = engine.workspace_bytes
    fraction = engine_reserve_fraction(engine, device, tp, pp)
    mem = float(device.mem_bytes)
    if engine.memory_fraction_of == "free":
        pool = fraction * (mem - weights - acts - work)
    elif engine.reserve_buckets:
        pool = fraction * mem - weights - work
    else:
        pool = fraction * mem - weights - acts - work
    return InstanceMemory(weights=weights, activations=acts, workspace=work, kv_pool=max(pool, 0.0),
                          kv_per_token=kv_bytes_per_token_per_gpu(model, tp, pp), capacity=mem,
                          block_tokens=engine.kv_block_tokens)
