"""Models that are not presets train under a plan exactly like one process running the model's own forward:
Hugging Face LlamaForCausalLM (random init from the seed, and real weights from a from_pretrained directory),
MixtralForCausalLM under expert parallelism, GPT-2 (tied embeddings) and a user's file.py:factory block model.
Losses of 3 AdamW steps to 1e-5 and every final parameter to 3e-4 (see PARAM_ATOL), on tiny models (h 64,
batch 8, seq 16).

The plans of one model and world size run in one forked process group, one after another, to keep the suite
fast; each plan is its own test against the shared results.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch._dynamo  # (DTensor imports it on first use: ~5 s per forked rank unless done here)
import torch.nn.functional as F
from harness import run_ranks

from autoplan.execute.source import model_spec
from autoplan.execute.train import TrainOptions, full_parameters, make_batch, train
from autoplan.execute.weights import materialise
from autoplan.plan.types import ParallelConfig

transformers = pytest.importorskip("transformers")

STEPS, BATCH, SEQ, VOCAB = 3, 8, 16, 128
BLOCK_MODEL = str(Path(__file__).parents[1] / "fixtures" / "models" / "block_lm.py") + ":build"


def _llama_config() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=8,
                                    num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=64)


def _mixtral_config() -> transformers.MixtralConfig:
    return transformers.MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                                      num_key_value_heads=4, vocab_size=VOCAB, num_local_experts=4,
                                      num_experts_per_tok=2, max_position_embeddings=64)


def _gpt2_config() -> transformers.GPT2Config:
    return transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64, resid_pdrop=0.0,
                                   embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)


def _meta(cls: type, config: object) -> torch.nn.Module:
    with torch.device("meta"):
        return cls(config)


# --- the reference: the model's own forward in one process, no autoplan.execute machinery ---------------------

def _reference(rank: int, world: int, spec, real: torch.nn.Module | None, steps: int) -> dict:
    if real is None:  # the seeded init every plan materialises shard by shard
        model = spec.build()
        materialise(model, device=torch.device("cpu"), seed=0, std=spec.init_std)
    else:
        model = real
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    losses = []
    for step in range(steps):
        batch = make_batch(0, step, global_batch=BATCH, seq_len=SEQ, vocab_size=VOCAB)
        out = model(input_ids=batch[:, :-1]) if hasattr(model, "can_generate") else model(batch[:, :-1])
        logits = getattr(out, "logits", out)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), batch[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def reference(spec, real: torch.nn.Module | None = None, steps: int = STEPS) -> dict:
    return run_ranks(_reference, 1, spec, real, steps)[0]


def _plans(rank: int, world: int, spec, configs: list[ParallelConfig], options: TrainOptions) -> list[dict]:
    out = []
    for config in configs:
        result = train(spec, config, options, device=torch.device("cpu"))
        out.append({"losses": result.losses, "start": result.start_step, "params": full_parameters(result.parts)})
    return out


def run_plans(spec, configs: list[ParallelConfig], world: int, **options) -> list[dict]:
    """Train each config in turn on one group of `world` ranks; per config rank 0's losses and all parameters."""
    options = TrainOptions(steps=options.pop("steps", STEPS), global_batch=BATCH, seq_len=SEQ, **options)
    per_rank = run_ranks(_plans, world, spec, configs, options, deadline_s=300.0)
    merged = []
    for i in range(len(configs)):
        params: dict[str, torch.Tensor] = {}
        for rank_results in per_rank:
            params.update(rank_results[i]["params"])
            assert rank_results[i]["losses"] == per_rank[0][i]["losses"], "ranks disagree on the global loss"
        merged.append({"losses": per_rank[0][i]["losses"], "start": per_rank[0][i]["start"], "params": params})
    return merged


# AdamW's first steps move each weight by about lr * sign(gradient): where a gradient is near zero, float32
# differences in summation order (sharded matmuls, reductions) can flip that sign, so a few weights differ by
# up to about lr = 1e-3 while the losses agree to 1e-6. A bug (a wrong shard, a missing reduction) moves whole
# tensors by that much.
PARAM_ATOL = 3e-4


def assert_matches(run: dict, ref: dict) -> None:
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-5)
    assert sorted(run["params"]) == sorted(ref["params"]), "parameter names differ from the model's"
    for name, value in ref["params"].items():
        torch.testing.assert_close(run["params"][name], value, rtol=1e-4, atol=PARAM_ATOL,
                                   msg=lambda m, n=name: f"{n}: {m}")


# --- HF Llama, random init from the seed: every technique on 4 ranks, and 3D on 8 -------------------------------

LLAMA_PLANS = {
    "tp2-sp-dp2": ParallelConfig(tp=2, sp=True, dp=2),
    "pp2-1f1b-dp2": ParallelConfig(pp=2, dp=2, schedule="1f1b", microbatch=2),
    "pp2-interleaved-v2-dp2": ParallelConfig(pp=2, dp=2, schedule="interleaved", virtual_stages=2, microbatch=2),
    "fsdp2-dp4-zero3": ParallelConfig(dp=4, zero=3),
    "cp2-dp2-selective": ParallelConfig(cp=2, dp=2, zero=2, recompute="selective"),
}


@pytest.fixture(scope="module")
def llama() -> tuple:
    spec, _ = model_spec(_meta(transformers.LlamaForCausalLM, _llama_config()))
    runs = run_plans(spec, list(LLAMA_PLANS.values()), 4)
    return spec, reference(spec), dict(zip(LLAMA_PLANS, runs))


@pytest.mark.parametrize("name", list(LLAMA_PLANS))
def test_hf_llama_plans_train_like_one_process(llama: tuple, name: str) -> None:
    _, ref, runs = llama
    assert_matches(runs[name], ref)


def test_hf_llama_3d_pp2_dp2_tp2_on_8_ranks(llama: tuple) -> None:
    spec, ref, _ = llama
    config = ParallelConfig(pp=2, dp=2, tp=2, sp=True, zero=3, schedule="1f1b", microbatch=2, recompute="full")
    assert_matches(run_plans(spec, [config], 8)[0], ref)


def test_hf_checkpoint_resumes_under_another_plan(llama: tuple, tmp_path: Path) -> None:
    spec = llama[0]
    first = run_plans(spec, [ParallelConfig(dp=2, zero=3)], 2, steps=2, save_every=2, checkpoint_dir=str(tmp_path))[0]
    resumed = run_plans(spec, [ParallelConfig(tp=2, sp=True, pp=2, microbatch=2)], 4, steps=4,
                        resume=str(tmp_path))[0]
    assert resumed["start"] == 2
    assert_matches({"losses": first["losses"] + resumed["losses"], "params": resumed["params"]},
                   reference(spec, steps=4))


def test_real_weights_from_a_pretrained_directory(tmp_path: Path) -> None:
    torch.manual_seed(1)
    real = transformers.LlamaForCausalLM(_llama_config())
    real.save_pretrained(tmp_path)  # model.safetensors + config.json
    spec, _ = model_spec(str(tmp_path))
    assert spec.weights == str(tmp_path.resolve())
    assert_matches(run_plans(spec, [ParallelConfig(tp=2, sp=True, dp=2, zero=3)], 4)[0], reference(spec, real))


# --- HF Mixtral: expert parallelism over the stacked experts ----------------------------------------------------

MIXTRAL_PLANS = {
    "ep2-dp2-zero3": ParallelConfig(ep=2, dp=2, zero=3),
    "ep4": ParallelConfig(ep=4),
    "ep2-tp2-sp": ParallelConfig(ep=2, tp=2, sp=True),
}


@pytest.fixture(scope="module")
def mixtral() -> tuple:
    spec, _ = model_spec(_meta(transformers.MixtralForCausalLM, _mixtral_config()))
    return reference(spec), dict(zip(MIXTRAL_PLANS, run_plans(spec, list(MIXTRAL_PLANS.values()), 4)))


@pytest.mark.parametrize("name", list(MIXTRAL_PLANS))
def test_hf_mixtral_expert_parallel_plans(mixtral: tuple, name: str) -> None:
    ref, runs = mixtral
    assert_matches(runs[name], ref)


# --- a user's own block model (file.py:factory) and GPT-2 (tied embedding and head) ----------------------------

def test_user_factory_block_model_tp2_sp_pp2_and_fsdp() -> None:
    spec, _ = model_spec(BLOCK_MODEL)
    assert spec.family == "module"
    runs = run_plans(spec, [ParallelConfig(tp=2, sp=True, pp=2, microbatch=2), ParallelConfig(dp=4, zero=3)], 4)
    ref = reference(spec)
    for run in runs:
        assert_matches(run, ref)


def test_gpt2_tied_embeddings_under_fsdp_and_context_parallel() -> None:
    spec, _ = model_spec(_meta(transformers.GPT2LMHeadModel, _gpt2_config()))
    assert spec.family == "gpt2" and spec.roles.tied
    runs = run_plans(spec, [ParallelConfig(dp=2, zero=3), ParallelConfig(cp=2, recompute="selective")], 2)
    ref = reference(spec)
    for run in runs:
        assert_matches(run, ref)


# --- a real tokenizer's vocabulary: Llama 3's 128,256 ids from a uint32 .bin token file, vocab-parallel over tp --

def _data_reference(rank: int, world: int, spec, data: str, steps: int) -> list[float]:
    from autoplan.execute.data import load_tokens, sample_windows

    model = spec.build()
    materialise(model, device=torch.device("cpu"), seed=0, std=spec.init_std)
    vocab = spec.roles.vocab_size
    tokens = load_tokens(data, vocab_size=vocab, seq_len=SEQ)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    losses = []
    for step in range(steps):
        batch = sample_windows(tokens, 0, step, global_batch=BATCH, seq_len=SEQ)
        logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, vocab).float(), batch[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_llama3_vocabulary_from_a_uint32_token_file(tmp_path: Path) -> None:
    import numpy as np

    vocab = 128_256
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=64)
    spec, _ = model_spec(_meta(transformers.LlamaForCausalLM, config))
    data = tmp_path / "tokens.bin"
    ids = np.random.default_rng(0).integers(0, vocab, 4096).astype(np.uint32)
    ids[:2] = (vocab - 1, 65_536)  # ids a uint16 file could not hold
    ids.tofile(data)
    run = run_plans(spec, [ParallelConfig(tp=2, sp=True)], 2, steps=2, data=str(data))[0]
    torch.testing.assert_close(torch.tensor(run["losses"]),
                               torch.tensor(run_ranks(_data_reference, 1, spec, str(data), 2)[0]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["qwen2-tied", "mistral"])
def test_qwen2_with_tied_vocab_parallel_head_and_mistral_under_tp(name: str) -> None:
    shape = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8,
             "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 64}
    if name == "qwen2-tied":  # lm_head.weight is embed_tokens.weight: one vocab-sharded parameter
        model = _meta(transformers.Qwen2ForCausalLM, transformers.Qwen2Config(tie_word_embeddings=True, **shape))
    else:
        model = _meta(transformers.MistralForCausalLM, transformers.MistralConfig(**shape))
    spec, _ = model_spec(model)
    assert spec.roles.tied == (name == "qwen2-tied")
    assert_matches(run_plans(spec, [ParallelConfig(tp=2, sp=True)], 2)[0], reference(spec))
