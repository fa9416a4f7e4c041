"""Peak memory per rank of a model built on the meta device and trained under FSDP2 (zero=3): each rank
materialises only its own shards (execute.weights), block by block before FSDP2 shards them, so a rank's peak
is its share of the model state plus the process itself, not the whole model. Prints the model's full float32
training state (weights, gradients, AdamW: 16 bytes per parameter) and each rank's peak RSS from the run report
(getrusage ru_maxrss), next to the same process's RSS before any model exists. RSS is noisy on a shared machine.

    python bench/shard_memory.py [--ranks 4] [--layers 16]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
from pathlib import Path

_GIB = 2**30


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--layers", type=int, default=16)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parents[1]))
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import autoplan
    from autoplan.plan.types import ParallelConfig

    config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=args.layers,
                         num_attention_heads=16, num_key_value_heads=8, vocab_size=32000)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # torch + transformers imported
    with open(os.devnull, "w") as quiet:
        report = autoplan.execute(ParallelConfig(dp=args.ranks, zero=3), model, steps=1, global_batch=args.ranks,
                                  seq_len=64, out=quiet)
    print(f"model: {params / 1e6:.0f} M parameters; full float32 training state {16 * params / _GIB:.2f} GiB "
          f"(weights {4 * params / _GIB:.2f} GiB)")
    print(f"a process with torch and transformers imported, no model: {baseline / _GIB:.2f} GiB RSS")
    for rank, peak in enumerate(report["peak_mem_bytes_per_rank"]):
        print(f"rank {rank} of {args.ranks} (dp={args.ranks}, zero=3): peak RSS {peak / _GIB:.2f} GiB")
    print(f"loss {report['losses'][0]:.4f}, step {report['step_times_s'][0]:.1f} s")


if __name__ == "__main__":
    main()
