"""`autoplan serve --run`: a tensor- and pipeline-parallel decode loop on real ranks, timing TTFT and
per-token latency.

Each rank builds the same seeded preset, keeps its pipeline stage (pp even stages, execute.pipeline's
split), shards it with the training executor's DTensor plan
(execute.tensor_parallel: column-parallel QKV / up, row-parallel output / down, vocab-parallel
embedding and head), and runs a static batch: one prefill pass over `batch` prompts of `input_len`
tokens, then `output_len - 1` greedy decode steps, each attending to a per-layer KV cache of the
local kv heads. TTFT = the prefill pass and its first token; TPOT = the mean decode step after it
(the definitions of autoplan.serve.types). With pp > 1 the stages pass the residual stream [B, S, h]
point to point (gloo send / recv, each tp rank to the same tp rank of the next stage) and the last
stage sends the token back to the first: one micro-batch, so one stage works at a time, as in a
pipelined instance serving a single lane. Rank 0 (first stage) times it; the collectives and sends
keep ranks in lockstep.

`run_serve(model, tp=..., pp=..., ...)` launches `python -m autoplan.execute.serve` on tp x pp ranks with torchrun
(execute.launch) and returns rank 0's report; the ranks report failures like the training worker.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn, TextIO

import torch
import torch.nn.functional as F

from autoplan.models.transformer import Transformer, apply_rope, rope_cos_sin


def _attend(attn: torch.nn.Module, x: torch.Tensor, cache: list[torch.Tensor], pos: int) -> torch.Tensor:
    """Self-attention of x [B, S, h] at positions pos.. with the layer's KV cache [B, L, kv_local, d]."""
    b, s, _ = x.shape
    d = attn.head_dim
    q = attn.wq(x).view(b, s, -1, d)
    k = attn.wk(x).view(b, s, -1, d)
    v = attn.wv(x).view(b, s, -1, d)
    if attn.use_rope:
        cos, sin = rope_cos_sin(torch.arange(pos, pos + s), d, attn.rope_theta)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    cache[0][:, pos:pos + s] = k
    cache[1][:, pos:pos + s] = v
    keys, values = cache[0][:, :pos + s].transpose(1, 2), cache[1][:, :pos + s].transpose(1, 2)
    q = q.transpose(1, 2)
    group = q.shape[1] // keys.shape[1]
    if group > 1:
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q, keys, values, is_causal=s > 1)
    return attn.wo(out.transpose(1, 2).reshape(b, s, -1))


def forward_cached(model: Transformer, tokens: torch.Tensor, caches: list[list[torch.Tensor]], pos: int,
                   pipe: Pipe | None = None) -> torch.Tensor | None:
    """Next-token ids [B] after `tokens` [B, S] placed at positions pos..pos+S-1 (greedy). With a
    pipeline (`pipe`), this rank runs its stage: the first embeds, the others receive the residual
    stream [B, S, h] from the previous stage; the last computes the token and sends it back to the
    first, which returns it (the middle stages return None)."""
    pipe = pipe or Pipe()
    x = model.embed(tokens) if pipe.first else pipe.recv_hidden(tokens.shape, model.config.hidden_size)
    for block, cache in zip(model.layers.values(), caches):
        x = x + _attend(block.attn, block.attn_norm(x), cache, pos)
        x = x + block.mlp(block.mlp_norm(x))
    if not pipe.last:
        pipe.send_hidden(x)
        return pipe.recv_token(tokens.shape[0]) if pipe.first else None
    logits = model.head(model.norm(x[:, -1:]))
    if hasattr(logits, "full_tensor"):  # vocab-parallel head: a DTensor sharded on the vocabulary
        logits = logits.full_tensor()
    token = logits[:, -1].argmax(dim=-1)
    pipe.send_token(token)
    return token


class Pipe:
    """This rank's place in a pipeline of `pp` stages of `tp` ranks each (global rank = stage x tp +
    tp rank): point-to-point sends of the residual stream to the same tp rank of the next stage, and
    of the sampled token from the last stage back to the first. pp = 1: no communication."""

    def __init__(self, pp: int = 1, stage: int = 0, tp: int = 1, tp_rank: int = 0) -> None:
        self.pp, self.stage, self.tp, self.tp_rank = pp, stage, tp, tp_rank
        self.first, self.last = stage == 0, stage == pp - 1

    def _rank(self, stage: int) -> int:
        return stage * self.tp + self.tp_rank

    def recv_hidden(self, token_shape: torch.Size, hidden: int) -> torch.Tensor:
        import torch.distributed as dist

        x = torch.empty(token_shape[0], token_shape[1], hidden)
        dist.recv(x, src=self._rank(self.stage - 1))
        return x

    def send_hidden(self, x: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.send(x.contiguous(), dst=self._rank(self.stage + 1))

    def send_token(self, token: torch.Tensor) -> None:
        if self.pp > 1:
            import torch.distributed as dist

            dist.send(token.contiguous(), dst=self._rank(0))

    def recv_token(self, batch: int) -> torch.Tensor:
        import torch.distributed as dist

        token = torch.empty(batch, dtype=torch.long)
        dist.recv(token, src=self._rank(self.pp - 1))
        return token


def _caches(model: Transformer, batch: int, length: int) -> list[list[torch.Tensor]]:
    d = model.config.head_dim
    out = []
    for block in model.layers.values():
        kv_local = block.attn.wk.weight.shape[0] // d
        if hasattr(block.attn.wk.weight, "to_local"):
            kv_local = block.attn.wk.weight.to_local().shape[0] // d
        out.append([torch.zeros(batch, length, kv_local, d) for _ in range(2)])
    return out


def generate(model: Transformer, prompts: torch.Tensor, output_len: int,
             pipe: Pipe | None = None) -> tuple[torch.Tensor, float, list[float]]:
    """(generated ids [B, output_len], prefill seconds, decode step seconds) of one static batch; with
    a pipeline the ids are the first stage's (the others return zeros of that shape)."""
    batch, input_len = prompts.shape
    caches = _caches(model, batch, input_len + output_len)
    start = time.perf_counter()
    token = forward_cached(model, prompts, caches, 0, pipe)
    ttft = time.perf_counter() - start
    token = torch.zeros(batch, dtype=torch.long) if token is None else token
    out, steps = [token], []
    for i in range(output_len - 1):
        start = time.perf_counter()
        token = forward_cached(model, token[:, None], caches, input_len + i, pipe)
        steps.append(time.perf_counter() - start)
        token = torch.zeros(batch, dtype=torch.long) if token is None else token
        out.append(token)
    return torch.stack(out, dim=1), ttft, steps


def build(model_name: str, seed: int, tp_mesh: Any | None, pp: int = 1, stage: int = 0) -> Transformer:
    """The seeded preset (its pipeline stage `stage` of `pp` even stages, execute.pipeline's split:
    embed on the first, norm and head on the last), tensor-parallel over tp_mesh when given (the
    training executor's plan)."""
    from autoplan.execute.train import build_model

    model = build_model(model_name, seed).eval()
    if pp > 1:
        from autoplan.execute.pipeline import even_stages, extract_stage

        model = extract_stage(model, even_stages(model, pp)[stage], first=stage == 0, last=stage == pp - 1)
    if tp_mesh is not None and tp_mesh.size() > 1:
        from autoplan.execute.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(model, tp_mesh=tp_mesh, sp=False)
    return model


def prompts_for(seed: int, batch: int, input_len: int, vocab_size: int) -> torch.Tensor:
    return torch.randint(0, vocab_size, (batch, input_len), generator=torch.Generator().manual_seed(seed + 1))


@torch.no_grad()
def measure(model: Transformer, prompts: torch.Tensor, output_len: int, repeats: int,
            pipe: Pipe | None = None) -> dict[str, Any]:
    """Median TTFT and TPOT over `repeats` runs after one warm-up run, and the tokens."""
    ttfts, tpots, tokens = [], [], None
    for i in range(repeats + 1):
        tokens, ttft, steps = generate(model, prompts, output_len, pipe)
        if i:
            ttfts.append(ttft)
            tpots.append(statistics.mean(steps) if steps else 0.0)
    return {"ttft_s": statistics.median(ttfts), "tpot_s": statistics.median(tpots),
            "tokens": tokens.tolist() if tokens is not None else []}


def _rank_main(args: argparse.Namespace, rank: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)  # one thread per rank: the local-cpu profile's per-rank model
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout_s))
    tp = dist.get_world_size() // args.pp
    mesh = init_device_mesh("cpu", (args.pp, tp), mesh_dim_names=("pp", "tp"))
    stage, tp_rank = divmod(rank, tp)
    model = build(args.model, args.seed, mesh["tp"], pp=args.pp, stage=stage)
    pipe = Pipe(args.pp, stage, tp, tp_rank)
    prompts = prompts_for(args.seed, args.batch, args.input_len, model.config.vocab_size)
    dist.barrier()
    result = measure(model, prompts, args.output_len, args.repeats, pipe)
    if rank == 0:
        result.update(tp=tp, pp=args.pp, model=args.model, batch=args.batch, input_len=args.input_len,
                      output_len=args.output_len)
        Path(args.report).write_text(json.dumps(result) + "\n")
    dist.barrier()  # before destroy after DTensor work (TORCH_NOTES.md)
    dist.destroy_process_group()  # run_guarded then exits without interpreter teardown


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="autoplan.execute.serve")
    for name, kind in (("--model", str), ("--pp", int), ("--batch", int), ("--input-len", int), ("--output-len", int),
                       ("--seed", int), ("--repeats", int), ("--report", str), ("--run-dir", str),
                       ("--timeout-s", float)):
        p.add_argument(name, type=kind, required=True, dest=name[2:].replace("-", "_"))
    return p.parse_args(argv)


def run_serve(model: str, *, tp: int, batch: int, input_len: int, output_len: int, pp: int = 1, seed: int = 0,
              repeats: int = 3, timeout_s: float = 120.0, out: TextIO | None = None) -> dict[str, Any]:
    """Launch the decode loop on tp x pp gloo ranks (torchrun) and return rank 0's measurement."""
    from autoplan.execute.launch import run_torchrun, torchrun_command

    for name, value in (("tp", tp), ("pp", pp), ("batch", batch), ("input_len", input_len),
                        ("output_len", output_len)):
        if value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value}")
    with tempfile.TemporaryDirectory(prefix="autoplan-serve-") as run_dir:
        report = os.path.join(run_dir, "report.json")
        args = ["--model", model, "--pp", str(pp), "--batch", str(batch), "--input-len", str(input_len), "--output-len",
                str(output_len), "--seed", str(seed), "--repeats", str(repeats), "--report", report,
                "--run-dir", run_dir, "--timeout-s", str(timeout_s)]
        cmd = torchrun_command(args, nproc_per_node=tp * pp, module="autoplan.execute.serve")
        run_torchrun(cmd, run_dir=run_dir, env={"OMP_NUM_THREADS": "1"}, out=out)
        return json.loads(Path(report).read_text())


def main(argv: list[str] | None = None) -> NoReturn:
    from autoplan.execute.worker import run_guarded

    args = parse_args(argv)
    run_guarded(args.run_dir, lambda rank: _rank_main(args, rank))


if __name__ == "__main__":
    main()
