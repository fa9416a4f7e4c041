"""The encode stage of a model with components (encode -> prefill -> decode): a vision tower + projector
runs once per request over its images before the language model prefills them. Pure, like physics.py.

- serve_encoder: the ServeEncoder of a captured graph.types.EncoderSplit (FLOPs per image from the
  capture, the blocks' shape, the hand-off in the serving activation dtype).
- encode_s: one encoder pass over `images` images on a tp-sharded instance. Like prefill it is
  compute-bound (hundreds of tokens per image through every weight; Williams et al., "Roofline", CACM
  2009): max(GEMM FLOPs / (tp x the activation dtype's peak x matmul_efficiency), weights / achievable
  bandwidth) + attention-core FLOPs / (tp x peak x attention_efficiency) + the norms' and residuals'
  10 h elements per token per block at achievable bandwidth (physics._ELEMENTWISE_PER_TOKEN) + two TP
  all-reduces of tokens x h per block (Megatron's row-parallel output and down projections, Shoeybi et
  al. 2019; physics.allreduce_s) + the engine's fixed cost per kernel for each block's kernels
  (engine kernels_per_block x kernel_launch_s, measured on LM layers, which launch the same norm / GEMM /
  attention / activation kernels). The encoder is priced in the activation dtype (16-bit) even under
  fp8 LM weights: whether a tower is quantized depends on the checkpoint (vLLM hands LLaVA's CLIP tower
  the model's quant_config, and fp8 checkpoints may list the tower among their ignored layers), so
  with fp8 weights this is the slower case.
- handoff_s: an encoder with devices of its own sends each request's image features to the prefill
  instance over the link between the groups (NVLink in a node, the NIC across nodes): cost.comm.p2p_s,
  alpha + bytes / (bw x p2p_bw_fraction); every tp rank of the prefill instance receives them at once
  (vLLM's embedding of the prompt is replicated over tp), so one message's time.
- encoder_memory: the encoder's weights per device of its own instance and what it leaves for the engine.

Not charged: the encoder's activations (one request's images: for LLaVA-1.5, 577 tokens x 4 x 1024 x 2
bytes per layer, about 5 MB), vLLM's truncation of the unused last CLIP layer (vision_feature_layer -2:
the capture runs all 24, as transformers does), and caching of repeated images.
"""

from __future__ import annotations

from autoplan.cost.comm import p2p_s
from autoplan.graph.types import EncoderSplit
from autoplan.serve.memory import engine_reserve_fraction
from autoplan.serve.physics import _ELEMENTWISE_PER_TOKEN, Hardware, allreduce_s
from autoplan.serve.types import ServeEncoder


def serve_encoder(split: EncoderSplit, *, act_bytes: float) -> ServeEncoder:
    """The encoder of `split`, per image (the capture's microbatch divided out); ValueError when its
    blocks are not recognised transformer blocks (tp needs their heads)."""
    graph = split.encoder
    mb = max(graph.microbatch, 1)
    block = next((b for b in graph.blocks if b.hidden_size and b.num_heads), None)
    if block is None:
        raise ValueError(f"the encoder of {graph.model_name} has no recognised transformer block: serving plans "
                         f"price a transformer encoder (a ViT / CLIP / SigLIP tower)")
    return ServeEncoder(name="+".join(split.encoder_components),
                        matmul_flops=sum(layer.fwd_matmul_flops for layer in graph.layers) / mb,
                        attention_flops=sum(layer.fwd_attention_flops for layer in graph.layers) / mb,
                        num_blocks=len(graph.blocks), tokens=graph.seq_len, h=block.hidden_size, a=block.num_heads,
                        params=graph.num_params, handoff_bytes=split.handoff_bytes_per_sample / graph.dtype_bytes * act_bytes,
                        output_tokens=split.encoder_tokens_per_sample)


def check_encoder_tp(encoder: ServeEncoder, tp: int) -> None:
    if tp < 1 or encoder.a % tp:
        raise ValueError(f"encoder_tp={tp} does not divide the encoder's {encoder.a} attention heads: choose a "
                         f"divisor of {encoder.a}")


def encode_parts(encoder: ServeEncoder, images: float, *, tp: int, act_bytes: float,
                 hw: Hardware) -> dict[str, float]:
    """Seconds of one encoder pass over `images` images on one device of a tp instance, by cause."""
    if images <= 0:
        return {}
    dev = hw.cluster.device
    peak = hw.attention_peak_flops  # the activation dtype's tensor-core peak
    tokens = images * encoder.tokens
    gemm = images * encoder.matmul_flops / (tp * peak * dev.matmul_efficiency)
    weights = encoder.params * act_bytes / tp / hw.bw
    return {"encoder_gemm": max(gemm, weights),
            "encoder_attention": images * encoder.attention_flops / (tp * peak * dev.attention_efficiency),
            "encoder_elementwise": encoder.num_blocks * tokens * _ELEMENTWISE_PER_TOKEN * encoder.h * act_bytes / hw.bw,
            "encoder_allreduce": encoder.num_blocks * 2.0 * allreduce_s(tokens * encoder.h * act_bytes, tp, hw),
            "encoder_launch": encoder.num_blocks * hw.engine.kernels_per_block * hw.engine.kernel_launch_s}


def encode_s(encoder: ServeEncoder, images: float, *, tp: int, act_bytes: float, hw: Hardware) -> float:
    """One encoder pass over `images` images (see the module docstring)."""
    return sum(encode_parts(encoder, images, tp=tp, act_bytes=act_bytes, hw=hw).values())


def handoff_s(encoder: ServeEncoder, images: float, *, crosses_nodes: bool, hw: Hardware) -> float:
    """One request's image features from its encoder instance to its prefill instance."""
    if images <= 0:
        return 0.0
    return p2p_s(images * encoder.handoff_bytes, crosses_nodes, hw.cluster)


def encoder_memory(encoder: ServeEncoder, *, tp: int, act_bytes: float, hw: Hardware) -> tuple[float, float]:
    """(weights per device, the engine's budget per device) of an encoder instance of tp devices: the
    budget is the engine's memory fraction of the device (memory.engine_reserve_fraction) less its
    workspace."""
    dev = hw.cluster.device
    budget = engine_reserve_fraction(hw.engine, dev, tp, 1) * dev.mem_bytes - hw.engine.workspace_bytes
    return encoder.params * act_bytes / tp, budget
