"""The serving API and CLI contract: names, bad input as one line, the captured model's shapes, and
`autoplan serve` end to end on the local profile."""

from __future__ import annotations

import json

import pytest
import torch

import autoplan
from autoplan.cli.main import main
from autoplan.graph.capture import capture
from autoplan.models import preset
from autoplan.serve.model import serve_model


def test_the_public_names_are_exported() -> None:
    assert callable(autoplan.serve_plan) and callable(autoplan.serve_estimate)
    assert {"serve_plan", "serve_estimate"} <= set(autoplan.__all__)


def test_serve_model_of_a_captured_preset_has_its_shapes_and_parameters() -> None:
    with torch.device("meta"):
        model = preset("tiny-llama")
    served = serve_model(capture(model, seq_len=16, microbatch=1))
    c = model.config
    block = served.blocks[0]
    assert (block.count, block.h, block.a, block.g, block.d, block.f, block.n_mlp) == (4, 64, 8, 4, 8, 128, 3)
    assert served.num_params == sum(p.numel() for p in model.parameters())
    assert served.kv_bytes_per_token() == 2 * c.num_layers * c.num_kv_heads * c.head_dim * 2


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"concurrency": 4, "rate": 1.0}, "give exactly one of concurrency"),
    ({}, "give exactly one of concurrency"),
    ({"concurrency": 0}, "concurrency must be a positive integer"),
    ({"concurrency": 4, "ttft_slo_s": -1}, "ttft_slo_s must be a positive number"),
    ({"concurrency": 4, "tpp": 2}, r"unknown option\(s\) \['tpp'\]"),
    ({"concurrency": 4, "engine": "sglng"}, r"did you mean 'sglang'"),
])
def test_bad_serve_plan_input_is_one_clear_line(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        autoplan.serve_plan("tiny-llama", "local-cpu", input_len=32, output_len=8, **kwargs)


def test_serve_estimate_rejects_a_config_that_does_not_fit_the_cluster() -> None:
    with pytest.raises(ValueError, match=r"tp=16 is larger than a node of 8 devices"):
        autoplan.serve_estimate("tiny-llama", "local-cpu", {"tp": 16}, input_len=8, output_len=8, concurrency=1)
    with pytest.raises(ValueError, match=r"unknown serving config key\(s\) \['dp'\]"):
        autoplan.serve_estimate("tiny-llama", "local-cpu", {"dp": 2}, input_len=8, output_len=8, concurrency=1)


def test_cli_serve_prints_the_plan_and_writes_json_and_plot(tmp_path, capsys) -> None:
    out_json, out_png = tmp_path / "plans.json", tmp_path / "pareto.png"
    code = main(["serve", "--model", "tiny-llama", "--cluster", "local-cpu", "--input-len", "32", "--output-len",
                 "16", "--concurrency", "4", "--tpot-slo", "1", "--top-k", "3", "--json", str(out_json),
                 "--plot", str(out_png), "--max-batch", "8", "--pp", "1"])
    assert code == 0
    text = capsys.readouterr().out
    assert "vLLM serve: vllm serve tiny-llama" in text and "SGLang serve: python -m sglang.launch_server" in text
    data = json.loads(out_json.read_text())
    assert len(data["plans"]) == 3 and data["plans"][0]["meets_slo"] is True
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_serve_bad_input_exits_2_with_one_line(capsys) -> None:
    assert main(["serve", "--model", "tiny-llama", "--cluster", "local-cpu", "--input-len", "8", "--output-len", "8",
                 "--rate", "1", "--run"]) == 2
    assert "autoplan: error: --run times a static batch of --concurrency prompts" in capsys.readouterr().err
    assert main(["serve", "--model", "tiny-llama", "--cluster", "local-cpu", "--input-len", "8", "--output-len", "8",
                 "--concurrency", "1", "--engine", "vlm"]) == 2
    assert "did you mean 'vllm'" in capsys.readouterr().err
