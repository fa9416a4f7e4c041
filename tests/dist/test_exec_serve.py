"""autoplan.execute.serve on 2 gloo ranks: the tensor-parallel decode loop (DTensor TP, a KV cache of
the local kv heads) and the two-stage pipeline (send / recv of the residual stream and the token)
generate exactly the tokens of the single-process loop and of the full-sequence forward of the same
seeded model, and report positive TTFT and per-token times."""

from __future__ import annotations

import torch
from harness import run_ranks


def _decode(rank: int, world_size: int, model_name: str, batch: int, input_len: int, output_len: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from autoplan.execute.serve import build, measure, prompts_for

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",)) if world_size > 1 else None
    model = build(model_name, 0, mesh)
    prompts = prompts_for(0, batch, input_len, model.config.vocab_size)
    result = measure(model, prompts, output_len, repeats=1)
    if world_size == 1:  # the reference: greedy decoding by re-running the whole sequence, no cache
        seq = prompts
        with torch.no_grad():
            for _ in range(output_len):
                seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
        result["full_forward"] = seq[:, input_len:].tolist()
    return result


def test_tensor_parallel_decode_matches_one_process() -> None:
    ref = run_ranks(_decode, 1, "tiny-llama", 2, 12, 6, deadline_s=120)[0]
    assert ref["tokens"] == ref["full_forward"]  # the KV-cached loop decodes what the plain forward does
    results = run_ranks(_decode, 2, "tiny-llama", 2, 12, 6, deadline_s=120)
    assert results[0]["tokens"] == ref["tokens"] and results[1]["tokens"] == ref["tokens"]
    assert results[0]["ttft_s"] > 0 and results[0]["tpot_s"] > 0


def _pipeline(rank: int, world_size: int, model_name: str, batch: int, input_len: int, output_len: int) -> dict:
    from autoplan.execute.serve import Pipe, build, measure, prompts_for

    model = build(model_name, 0, None, pp=world_size, stage=rank)
    prompts = prompts_for(0, batch, input_len, model.config.vocab_size)
    return measure(model, prompts, output_len, repeats=1, pipe=Pipe(world_size, rank))


def test_pipeline_decode_matches_one_process() -> None:
    ref = run_ranks(_decode, 1, "tiny-llama", 2, 12, 6, deadline_s=120)[0]
    results = run_ranks(_pipeline, 2, "tiny-llama", 2, 12, 6, deadline_s=120)
    assert results[0]["tokens"] == ref["tokens"]  # the first stage holds the tokens the last one sampled
    assert results[0]["ttft_s"] > 0 and results[0]["tpot_s"] > 0
