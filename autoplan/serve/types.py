"""The serving vocabulary: the model as the serving cost model sees it, a serving engine's profile, a
serving configuration, the workload, and the estimate. Frozen values; no torch.

Definitions used everywhere (as in vLLM's benchmarks/benchmark_serving.py and NVIDIA genai-perf):
- TTFT (time to first token): from the moment a request arrives at the engine (its HTTP arrival,
  queueing included) to the moment its first output token exists. The first token is produced by the
  prefill pass; with disaggregation it includes the KV transfer to the decode group. For a model with an
  encoder (a vision tower + projector) it includes encoding the request's images (and, when the encoder
  has devices of its own, its queue there and the hand-off of the image features to the prefill group).
- input_len counts the prompt's text tokens; a model with an encoder prefills input_len + images x the
  tokens each image fills (LLaVA-1.5: 576), and those tokens occupy the KV cache like the text's.
- TPOT (time per output token): (end-to-end latency - TTFT) / (output_len - 1), the mean gap between
  consecutive output tokens after the first (genai-perf calls it ITL, inter-token latency). Network and
  detokenizer time outside the engine are not modelled.
- tokens_per_s: OUTPUT tokens per second over all replicas at the stated concurrency or rate;
  tokens_per_s_per_gpu divides it by every device the plan uses (prefill and decode groups).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockGroup:
    """`count` identical transformer blocks: h hidden, a heads, g kv heads of head_dim d, FFN width f
    with n_mlp weight matrices (2 GELU, 3 SwiGLU); for MoE, `num_experts` routed experts of width f_e
    (top_k per token) and `num_shared` always-on experts. Parameter counts are per block."""

    count: int
    h: int
    a: int
    g: int
    d: int
    f: int
    n_mlp: int
    dense_params: int  # attention + dense MLP (or shared experts) + norms + router
    expert_params: int = 0  # all routed experts of one block
    num_experts: int = 0
    top_k: int = 0
    ops_per_block: int = 0  # framework ops of one block's forward (graph nodes), for the eager host floor

    @property
    def params_per_expert(self) -> float:
        return self.expert_params / self.num_experts if self.num_experts else 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeEncoder:
    """The encoder side of a model with components (vision tower + projector), per image: its forward
    FLOPs by kind, the shape of its blocks (tp splits their heads), its parameters, and what it hands
    the language model (the features of `output_tokens` prompt positions, `handoff_bytes` in the
    serving activation dtype). Built by serve.encoder.serve_encoder from graph.types.EncoderSplit."""

    name: str
    matmul_flops: float  # forward GEMM FLOPs of one image (2 per multiply-add)
    attention_flops: float  # forward attention-core FLOPs (QK^T and PV) of one image
    num_blocks: int
    tokens: int  # sequence through the blocks per image (patches + class token)
    h: int
    a: int
    params: int
    handoff_bytes: float
    output_tokens: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeModel:
    """A decoder-only model for serving: its block groups in order, the embedding and the LM head.
    `weight_bytes` / `kv_bytes`: bytes per weight and per cached K/V element (2 for bf16, 1 for fp8)."""

    name: str
    blocks: tuple[BlockGroup, ...]
    vocab_size: int
    embed_params: int
    head_params: int
    weight_bytes: float = 2.0
    kv_bytes: float = 2.0
    act_bytes: float = 2.0  # activations between layers (bf16 even with fp8 weights)
    ends_bytes: float = 0.0  # embedding and LM head bytes per weight; 0: weight_bytes (see model.serve_model)
    encoder: ServeEncoder | None = None  # a model with components: encode -> prefill -> decode

    @property
    def ends_weight_bytes(self) -> float:
        return self.ends_bytes or self.weight_bytes

    @property
    def num_layers(self) -> int:
        return sum(b.count for b in self.blocks)

    @property
    def num_params(self) -> int:
        return self.embed_params + self.head_params + sum(
            b.count * (b.dense_params + b.expert_params) for b in self.blocks)

    @property
    def hidden_size(self) -> int:
        return self.blocks[0].h

    def kv_bytes_per_token(self) -> float:
        """K and V of every layer for one token, whole model: 2 * sum(layers * g * d) * kv_bytes."""
        return 2.0 * sum(b.count * b.g * b.d for b in self.blocks) * self.kv_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeEngine:
    """A serving engine's defaults and overheads, read from engines/serve/<name>.yaml (see engine.py,
    where every field's meaning is given; the YAML files give each value's source)."""

    name: str
    description: str = ""
    memory_fraction: float  # share of device memory (or of free memory) the engine may use
    memory_fraction_of: str  # "total" (vLLM, SGLang) or "free" (TensorRT-LLM: free after weights)
    # SGLang: reserved bytes = base + per_rank * tp * pp for the first bucket whose device memory is
    # under max_mem_bytes; the static fraction is then (mem - reserved) / mem. Empty: use memory_fraction.
    reserve_buckets: tuple[tuple[float, float, float], ...] = ()
    workspace_bytes: float = 0.0  # non-KV buffers beyond activations (cuBLAS/NCCL/attention workspaces)
    kv_block_tokens: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    large_gpu_min_mem_bytes: float = 0.0  # engines that pick bigger defaults on big GPUs
    large_gpu_exclude: tuple[str, ...] = ()
    large_gpu_max_num_seqs: int = 0
    large_gpu_max_num_batched_tokens: int = 0
    chunked_prefill: bool = True
    cuda_graph_max_batch: int = 0  # decode batches up to this replay a CUDA graph (no host launch cost)
    kernels_per_block: int = 0  # kernels one block launches besides its all-reduces (the engine's layer code)
    kernel_launch_s: float = 0.0  # fixed time each of them adds: launch + dependency gap (graph node or stream)
    quant_kernels_per_block: int = 0  # extra activation-quantization kernels per block under 8-bit weights
    # decode GEMMs (weights streamed once per step): achieved fraction of the datasheet bandwidth by
    # weight width, the engine's GEMM library measured at small M; 0: the device's mem_bw_efficiency
    gemm_bw_efficiency: float = 0.0  # 16-bit weights
    gemm_bw_efficiency_8bit: float = 0.0  # fp8 / int8 weights
    decode_attention_tensor_cores: bool = True  # False: decode QK^T / PV run on CUDA cores (the fp32 peak)
    step_overhead_s: float = 0.0  # exposed host time per engine iteration (scheduling, sampling, sync)
    step_overhead_per_seq_s: float = 0.0  # and per running sequence (input preparation, output processing)
    # custom all-reduce: (tp, ((bytes, seconds), ...)) measured tables; NCCL (the cluster's alpha-beta)
    # above custom_allreduce_max_bytes or for a tp without a table
    allreduce_table: tuple[tuple[int, tuple[tuple[float, float], ...]], ...] = ()
    custom_allreduce_max_bytes: float = 0.0
    source: str = ""

    def batch_defaults(self, device_name: str, device_mem_bytes: float) -> tuple[int, int]:
        """(max_num_seqs, max_num_batched_tokens) the engine picks on this device."""
        big = (self.large_gpu_min_mem_bytes > 0 and device_mem_bytes >= self.large_gpu_min_mem_bytes
               and not any(s.lower() in device_name.lower() for s in self.large_gpu_exclude))
        if big:
            return (self.large_gpu_max_num_seqs or self.max_num_seqs,
                    self.large_gpu_max_num_batched_tokens or self.max_num_batched_tokens)
        return self.max_num_seqs, self.max_num_batched_tokens


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeConfig:
    """One serving layout. Aggregated: `replicas` instances of tp x pp devices each do prefill and
    decode. Disaggregated: `prefill_replicas` instances of prefill_tp x prefill_pp devices prefill and
    hand the KV cache to `replicas` decode instances of tp x pp devices (P:D = prefill_replicas:replicas).
    ep > 1 shards the routed experts of a MoE over ep ranks of each instance's tp group (ep divides tp).
    max_batch caps the requests one instance decodes at once (vLLM --max-num-seqs).
    A model with an encoder: encoder_replicas = 0 runs it on the devices that prefill (sharded over their
    tp, as vLLM does by default); encoder_replicas >= 1 gives it instances of its own, encoder_tp devices
    each, which hand the image features to the prefill group."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    replicas: int = 1
    max_batch: int = 256
    disaggregated: bool = False
    prefill_tp: int = 0  # 0: same as tp
    prefill_pp: int = 0  # 0: same as pp
    prefill_replicas: int = 0  # 0 when aggregated; >= 1 when disaggregated
    encoder_tp: int = 0  # 0: no encoder group of its own (or not given: 1 when encoder_replicas >= 1)
    encoder_replicas: int = 0  # 0: the encoder runs with the prefill instances (co-located)

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep", "replicas", "max_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.tp % self.ep:
            raise ValueError(f"ep={self.ep} must divide tp={self.tp}: experts are sharded over ranks of the tp group")
        if self.disaggregated and self.prefill_replicas < 1:
            raise ValueError("a disaggregated config needs prefill_replicas >= 1 (the P of P:D)")
        if not self.disaggregated and self.prefill_replicas:
            raise ValueError(f"prefill_replicas={self.prefill_replicas} needs disaggregated=True")
        object.__setattr__(self, "prefill_tp", self.prefill_tp or self.tp)
        object.__setattr__(self, "prefill_pp", self.prefill_pp or self.pp)
        for name in ("encoder_tp", "encoder_replicas"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if self.encoder_tp and not self.encoder_replicas:
            raise ValueError(f"encoder_tp={self.encoder_tp} needs encoder_replicas >= 1 (encoder instances of "
                             f"their own); leave both 0 to run the encoder with the prefill instances")
        object.__setattr__(self, "encoder_tp", (self.encoder_tp or 1) if self.encoder_replicas else 0)

    @property
    def instance_devices(self) -> int:
        return self.tp * self.pp

    @property
    def decode_devices(self) -> int:
        """Devices that decode (aggregated: every device, which also prefills)."""
        return self.replicas * self.tp * self.pp

    @property
    def prefill_devices(self) -> int:
        """Devices that prefill (aggregated: the same devices as decode_devices)."""
        if not self.disaggregated:
            return self.decode_devices
        return self.prefill_replicas * self.prefill_tp * self.prefill_pp

    @property
    def encode_devices(self) -> int:
        """Devices of the encoder's own instances (0 when it runs with the prefill instances)."""
        return self.encoder_replicas * self.encoder_tp

    @property
    def num_devices(self) -> int:
        return self.decode_devices + (self.prefill_devices if self.disaggregated else 0) + self.encode_devices

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(prefill_devices=self.prefill_devices, decode_devices=self.decode_devices,
                   encode_devices=self.encode_devices, num_devices=self.num_devices)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ServeConfig:
        known = {f for f in cls.__dataclass_fields__}
        derived = {"prefill_devices", "decode_devices", "encode_devices", "num_devices"}
        unknown = sorted(set(data) - known - derived)
        if unknown:
            raise ValueError(f"unknown serving config key(s) {unknown}: known are {sorted(known)}")
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """Fixed-length requests: input_len prompt tokens, output_len generated tokens. Load is either a
    closed loop of `concurrency` clients (each sends its next request when the last one finishes, as
    genai-perf --concurrency and vLLM --max-concurrency do) or open-loop Poisson arrivals at `rate`
    requests/s (vLLM --request-rate)."""

    input_len: int
    output_len: int
    concurrency: int | None = None
    rate: float | None = None
    # open loop: gamma inter-arrival gaps of this shape (vLLM benchmark_serving --burstiness; 1 = Poisson)
    burstiness: float = 1.0
    # evaluate the queue with the discrete-event simulation (autoplan.serve.simulate) instead of Little's
    # law and M/D/1; implied by burstiness != 1
    simulate: bool = False
    images_per_request: int = 0  # images each request's encoder pass takes (models with an encoder)

    @property
    def simulated(self) -> bool:
        return self.simulate or self.burstiness != 1.0

    def __post_init__(self) -> None:
        for name in ("input_len", "output_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("give exactly one of concurrency (clients in a closed loop) or rate (requests/s)")
        if self.concurrency is not None and (isinstance(self.concurrency, bool) or
                                             not isinstance(self.concurrency, int) or self.concurrency < 1):
            raise ValueError(f"concurrency must be a positive integer, got {self.concurrency!r}")
        if self.rate is not None and not (isinstance(self.rate, (int, float)) and self.rate > 0):
            raise ValueError(f"rate must be a positive number of requests/s, got {self.rate!r}")
        if isinstance(self.burstiness, bool) or not isinstance(self.burstiness, (int, float)) or not self.burstiness > 0:
            raise ValueError(f"burstiness must be a positive number (1 = Poisson), got {self.burstiness!r}")
        if self.burstiness != 1.0 and self.rate is None:
            raise ValueError("burstiness shapes open-loop arrivals: give rate (requests/s), not concurrency")
        value = self.images_per_request
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"images_per_request must be a non-negative integer, got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ServeEstimate:
    """The predicted serving behaviour of one config (see the module docstring for TTFT and TPOT).
    Memory figures are per device of the decode group (the larger footprint)."""

    ttft_s: float
    tpot_s: float
    tokens_per_s: float
    tokens_per_s_per_gpu: float
    kv_cache_bytes_per_gpu: float  # the engine's KV pool on each decode device
    max_concurrency: int  # requests the plan holds at once: KV pool and batch cap, all decode replicas
    peak_mem_bytes: float  # weights + activations + workspace + the KV the served requests occupy
    fits: bool  # the weights and one full request fit the engine's budget on every device
    mem_capacity_bytes: float = 0.0
    weight_bytes_per_gpu: float = 0.0
    e2e_latency_s: float = 0.0
    request_rate: float = 0.0  # completed requests/s
    tokens_per_s_per_user: float = 0.0  # 1 / TPOT
    kv_transfer_s: float = 0.0  # disaggregation: prefill -> decode KV hand-off per request
    encode_s: float = 0.0  # encoding one request's images (part of TTFT)
    encoder_handoff_s: float = 0.0  # an encoder group of its own: image features -> the prefill group, per request
    encode_queue_s: float = 0.0  # an encoder group of its own: the wait for a free encoder instance (in queue_s)
    queue_s: float = 0.0  # part of TTFT spent waiting for a slot or the prefill queue
    stable: bool = True  # False: the arrival rate exceeds what the plan can serve (TTFT grows without bound)
    breakdown: tuple[tuple[str, float], ...] = ()  # one decode step's seconds by cause
    notes: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["breakdown"] = dict(self.breakdown)
        out["notes"] = list(self.notes)
        return out
