"""Serving engine profiles (engines/serve/*.yaml): load by name or path, the cluster profiles' one-line
errors, the engines' own defaults."""

from __future__ import annotations

import pytest

from autoplan.serve.engine import engine_names, load_engine


def test_shipped_engines_and_their_sourced_defaults() -> None:
    assert {"vllm", "sglang", "tensorrt-llm", "torch-eager"} <= set(engine_names())
    vllm = load_engine("vllm")
    assert (vllm.memory_fraction, vllm.kv_block_tokens, vllm.cuda_graph_max_batch) == (0.9, 16, 512)
    # vLLM EngineArgs.get_batch_defaults: big GPUs (>= 70 GiB, not A100) get 1024 seqs / 8192 tokens
    assert vllm.batch_defaults("H100-SXM5-80GB", 85_520_809_984) == (1024, 8192)
    assert vllm.batch_defaults("A100-SXM4-80GB", 85_899_345_920) == (256, 2048)
    trt = load_engine("tensorrt-llm")
    assert (trt.memory_fraction_of, trt.max_num_seqs, trt.max_num_batched_tokens) == ("free", 2048, 8192)
    assert load_engine(None).name == "vllm"


def test_an_engine_loads_from_a_path(tmp_path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("schema_version: 1\nname: mine\nmemory_fraction: 0.5\nmemory_fraction_of: total\n"
                    "allreduce_table:\n  2: [[0, 1.0e-6], [1000, 2.0e-6]]\n")
    engine = load_engine(str(path))
    assert engine.name == "mine" and engine.memory_fraction == 0.5
    assert engine.allreduce_table == ((2, ((0.0, 1e-6), (1000.0, 2e-6))),)


@pytest.mark.parametrize(("text", "message"), [
    ("memory_fraction: 0.5\nmemory_fraction_of: total\nkv_blok_tokens: 16\n",
     r"unknown field 'kv_blok_tokens' \(did you mean 'kv_block_tokens'\?\)"),
    ("memory_fraction: 1.5\nmemory_fraction_of: total\n", r"'memory_fraction' is a fraction"),
    ("memory_fraction: 0.5\nmemory_fraction_of: most\n", r"memory_fraction_of must be 'total' or 'free'"),
    ("memory_fraction_of: total\n", r"missing field 'memory_fraction'"),
])
def test_bad_engine_files_are_one_clear_line(tmp_path, text: str, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("schema_version: 1\nname: bad\n" + text)
    with pytest.raises(ValueError, match=message):
        load_engine(str(path))


def test_an_unknown_engine_name_suggests_the_close_one() -> None:
    with pytest.raises(ValueError, match=r"unknown serving engine 'vlm' \(did you mean 'vllm'\?\); known engines: "):
        load_engine("vlm")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_engine("no/such/engine.yaml")
