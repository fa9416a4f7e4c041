"""Device memory a training process holds outside its model states and activations, each part from the
code that allocates it (the profile's device.runtime_reserve_bytes is the CUDA context alone; NCCL's
buffers are cost.memory.nccl_buffer_bytes).

- cuBLAS workspaces as PyTorch allocates them (aten/src/ATen/cuda/CublasHandlePool.cpp,
  parseChosenWorkspaceSize / setCublasWorkspace): one workspace per (device, stream) a GEMM runs on,
  from the caching allocator, of ":4096:2:16:8" = 4096 KiB x 2 + 16 KiB x 8 by default, 4096 KiB x 8 =
  32 MiB on compute capability 9.x ("32MiB for Hopper"; 10.x and 12.x too on current main). cuBLASLt
  shares it (unified_cublas_and_lt_workspaces, on by default outside fbcode; before that a 1 MiB
  CUBLASLT_WORKSPACE_SIZE of its own, not counted). A training step's GEMMs run on the compute stream
  (autograd runs each backward op on its forward op's stream; FSDP2's all-gather and reduce-scatter streams
  copy and communicate, they issue no GEMM): Engine.gemm_streams, 1.
- Transformer Engine's own cuBLAS workspace (transformer_engine/pytorch/module/base.py get_workspace:
  torch.empty(get_cublas_workspace_size_bytes()), "32 MiB if using hopper, 4 MiB for all other
  architectures"), Engine.te_cublas_workspaces of them; initialize_ub repeats it _NUM_MAX_UB_STREAMS = 3
  times for the userbuffers' GEMM streams (`_cublas_workspace = get_workspace().repeat(_NUM_MAX_UB_STREAMS)`).
- Transformer Engine's userbuffers under Megatron-Core's --tp-comm-overlap (Engine.te_userbuffers): Megatron
  (megatron/training/initialize.py _initialize_tp_communicators) calls initialize_ub with
  shape = [seq_length * micro_batch_size // context_parallel_size, hidden_size], and TE's default config
  registers one buffer of that shape per overlapped GEMM: ring_exchange qkv_fprop, fc1_fprop, proj_dgrad,
  fc2_dgrad (CommOverlapP2P: buffer_bytes = shape bytes for an all-gather), pipeline proj_fprop, fc2_fprop
  and bulk qkv_dgrad, qkv_wgrad, fc1_dgrad, fc1_wgrad (CommOverlap: the shape's bytes): 10 buffers, in
  the training dtype, the all-gather ones (fp8_buf: qkv_fprop, qkv_dgrad, proj_dgrad, fc1_fprop, fc1_dgrad,
  fc2_dgrad) in uint8 under fp8 (register_user_buffer_collective: cudaMalloc / cuMemCreate of those bytes
  on every rank, outside PyTorch's allocator). Megatron asserts --sequence-parallel with
  --tp-comm-overlap (arguments.py), so only an SP plan with tp > 1 has them.
- Caching-allocator fragmentation: not counted. PyTorch's allocator (c10/cuda/CUDACachingAllocator.cpp)
  rounds a request up to kMinBlockSize = 512 B, serves requests above kSmallSize = 1 MiB from segments of
  kLargeBuffer = 20 MiB below kMinLargeAlloc = 10 MiB and of the request rounded up to kRoundLarge = 2 MiB
  above it, and splits a cached block for a smaller request when the remainder exceeds 1 MiB. The tensors
  the model counts are of s b h / t elements and the like: for the published shapes (h a multiple of 1024,
  s of 2048) multiples of 2 MiB at 16 bits, so their rounding is zero. What blocks freed between live
  tensors cost at the peak depends on the order of allocations and frees, which the model does not trace.
  The public measurements of the reserved-but-unallocated gap are of single workloads and far apart: 1.83
  GiB beside 75.31 GiB allocated at an OOM (vllm-project/compressed-tensors PR 587, Llama 3.3 70B
  offloading), 16.39 -> 10.83 GiB peak with expandable_segments (meta-pytorch/torchtune issue 1185, an 8B
  QLoRA on one A100): a percentage taken from them would be a fit, so none is added.
"""

from __future__ import annotations

from typing import Any

from autoplan.cluster.types import DeviceSpec
from autoplan.plan.engine import Engine

KIB = 1024
# aten/src/ATen/cuda/CublasHandlePool.cpp parseChosenWorkspaceSize: ":4096:2:16:8" default, 32 MiB on sm 9.x+
TORCH_CUBLAS_WORKSPACE_BYTES = 4096 * KIB * 2 + 16 * KIB * 8
TORCH_CUBLAS_WORKSPACE_BYTES_SM90 = 4096 * KIB * 8
# transformer_engine/pytorch/module/base.py get_cublas_workspace_size_bytes: 32 MiB on major >= 9, else 4 MiB
TE_CUBLAS_WORKSPACE_BYTES = 4_194_304
TE_CUBLAS_WORKSPACE_BYTES_SM90 = 33_554_432
TE_UB_STREAMS = 3  # base.py _NUM_MAX_UB_STREAMS
UB_BUFFERS = 10  # TE's default overlap config: 4 ring_exchange + 2 pipeline + 4 bulk
UB_FP8_BUFFERS = 6  # base.py fp8_buf: the all-gather buffers kept in uint8 under fp8


def cublas_workspace_bytes(device: DeviceSpec, engine: Engine, userbuffers: Any = False) -> Any:
    """PyTorch's cuBLAS workspaces (one per GEMM stream) plus Transformer Engine's (x TE_UB_STREAMS where
    its userbuffers run, `userbuffers` per candidate), bytes; zero on a device with no CUDA compute
    capability (a CPU profile)."""
    cc = device.compute_capability
    if cc <= 0:
        return 0.0 * userbuffers
    torch_ws = TORCH_CUBLAS_WORKSPACE_BYTES_SM90 if cc >= 90 else TORCH_CUBLAS_WORKSPACE_BYTES
    te_ws = TE_CUBLAS_WORKSPACE_BYTES_SM90 if cc >= 90 else TE_CUBLAS_WORKSPACE_BYTES
    te_copies = engine.te_cublas_workspaces * (1 + (TE_UB_STREAMS - 1) * userbuffers)
    return float(engine.gemm_streams * torch_ws) + te_ws * te_copies


def uses_userbuffers(engine: Engine, tp: Any, sp: Any) -> Any:
    """Whether TE's userbuffers are registered: the engine overlaps TP communication through them and the
    plan runs SP with tp > 1 (Megatron's --tp-comm-overlap requires --sequence-parallel). Works on arrays."""
    on = engine.tp_comm_overlap and engine.te_userbuffers
    return (tp > 1) * (sp > 0) * bool(on)


def userbuffer_bytes(engine: Engine, dtype: str, *, tp: Any, sp: Any, cp: Any, microbatch: Any, seq_len: int,
                     hidden: int) -> Any:
    """TE's communication buffers under --tp-comm-overlap: UB_BUFFERS of [seq_len * microbatch / cp, hidden]
    each, in the training dtype (fp32 / tf32: 4 bytes, else 2), the UB_FP8_BUFFERS all-gather ones in 1 byte
    under fp8 (module docstring). Works on arrays (the quick estimate's candidate columns)."""
    elements = seq_len * microbatch / cp * hidden
    wide = 4.0 if dtype in ("fp32", "tf32") else 2.0
    per_element = (UB_BUFFERS - UB_FP8_BUFFERS) * wide + UB_FP8_BUFFERS * 1.0 if dtype == "fp8" else UB_BUFFERS * wide
    return uses_userbuffers(engine, tp, sp) * elements * per_element


def runtime_buffer_bytes(device: DeviceSpec, engine: Engine, dtype: str, *, tp: Any, sp: Any, cp: Any,
                         microbatch: Any, seq_len: int, hidden: int) -> Any:
    """Library workspaces and engine buffers beside the CUDA context and NCCL's buffers, bytes:
    cublas_workspace_bytes + userbuffer_bytes."""
    if device.compute_capability <= 0:  # a CPU profile: no CUDA libraries
        return 0.0 * tp
    ub = uses_userbuffers(engine, tp, sp)
    return (cublas_workspace_bytes(device, engine, ub)
            + userbuffer_bytes(engine, dtype, tp=tp, sp=sp, cp=cp, microbatch=microbatch, seq_len=seq_len,
                               hidden=hidden))


def block_hidden(layers: Any) -> int:
    """The widest transformer block's hidden size among `layers` (0 without a recognised block)."""
    return max((layer.hidden_size for layer in layers), default=0)
