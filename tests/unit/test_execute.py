"""Executor pieces that need no process group: data, batch slicing, stage cuts and placement, recompute
wrapping, plan files, the torchrun command and the failure diagnosis."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from autoplan.cli.main import main
from autoplan.execute.launch import diagnose, read_plan, torchrun_command, write_plan
from autoplan.execute.pipeline import check_stages, even_stages, extract_stage, local_stage_indices
from autoplan.execute.recompute import apply_recompute, original_fqn
from autoplan.execute.tensor_parallel import check_tensor_parallel
from autoplan.execute.train import TrainOptions, TrainResult, check_divides, local_batch, make_batch, report
from autoplan.models import preset, preset_config
from autoplan.plan.types import Breakdown, Estimate, ParallelConfig, Plan, Recompute, Stage


class _Coords:
    """Stands in for SubMeshes: only this rank's coordinates are read by local_batch."""

    def __init__(self, **ranks: int) -> None:
        self.ranks = ranks

    def rank_on(self, axis: str) -> int:
        return self.ranks.get(axis, 0)


def test_make_batch_is_a_function_of_seed_and_step() -> None:
    a = make_batch(3, 5, global_batch=4, seq_len=8, vocab_size=50)
    assert a.shape == (4, 9) and int(a.min()) >= 0 and int(a.max()) < 50
    assert torch.equal(a, make_batch(3, 5, global_batch=4, seq_len=8, vocab_size=50))
    assert not torch.equal(a, make_batch(3, 6, global_batch=4, seq_len=8, vocab_size=50))
    assert not torch.equal(a, make_batch(4, 5, global_batch=4, seq_len=8, vocab_size=50))


def test_local_batches_tile_the_global_batch() -> None:
    config = ParallelConfig(dp=2, ep=2, cp=2)
    batch = make_batch(0, 0, global_batch=8, seq_len=8, vocab_size=100)
    inputs, targets = torch.full((8, 8), -1), torch.full((8, 8), -1)
    # zig-zag: 4 chunks of 2 positions; cp rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    columns = {0: [0, 1, 6, 7], 1: [2, 3, 4, 5]}
    for dp in range(2):
        for ep in range(2):
            for cp in range(2):
                x, y = local_batch(batch, config, _Coords(dp=dp, ep=ep, cp=cp))
                row = (dp * 2 + ep) * 2  # replica dp*ep + ep_rank owns 2 rows
                inputs[row:row + 2, columns[cp]], targets[row:row + 2, columns[cp]] = x, y
    assert torch.equal(inputs, batch[:, :-1]) and torch.equal(targets, batch[:, 1:])


@pytest.mark.parametrize("seq_len,cp", [(9, 3), (6, 2)])
def test_local_batch_rejects_a_sequence_2cp_does_not_divide(seq_len: int, cp: int) -> None:
    with pytest.raises(ValueError, match=f"2\\*cp = {2 * cp} equal chunks for cp={cp}"):
        local_batch(torch.zeros(2, seq_len + 1, dtype=torch.long), ParallelConfig(cp=cp), _Coords())


def test_local_batch_without_cp_takes_any_sequence_length() -> None:
    batch = torch.arange(14).reshape(2, 7)
    x, y = local_batch(batch, ParallelConfig(), _Coords())
    assert torch.equal(x, batch[:, :-1]) and torch.equal(y, batch[:, 1:])


def test_even_stages_and_placement() -> None:
    model = preset("tiny-gpt")
    stages = even_stages(model, 3)
    # the extra block goes to the middle stage, which holds neither the embedding nor the head
    assert [s.layer_names for s in stages] == [("embed", "layers.0"), ("layers.1", "layers.2"),
                                               ("layers.3", "norm", "head")]
    with pytest.raises(ValueError, match="has 4 blocks"):
        even_stages(model, 5)
    with pytest.raises(ValueError, match="must hold"):
        check_stages(model, stages[:2], 2)
    check_stages(model, (Stage(index=0, layer_names=("embed", "layers.0", "layers.1")),  # norm omitted
                         Stage(index=1, layer_names=("layers.2", "layers.3", "head"))), 2)
    with pytest.raises(ValueError, match="embed belongs on the first stage"):
        check_stages(model, (Stage(index=0, layer_names=("layers.0", "layers.1")),
                             Stage(index=1, layer_names=("layers.2", "layers.3", "embed"))), 2)
    looped = ParallelConfig(pp=2, schedule="interleaved", virtual_stages=2)
    assert [local_stage_indices(looped, r) for r in range(2)] == [(0, 2), (1, 3)]
    v_shape = ParallelConfig(pp=2, schedule="zb", virtual_stages=2)
    assert [local_stage_indices(v_shape, r) for r in range(2)] == [(0, 3), (1, 2)]


def test_stages_chained_compute_the_full_model() -> None:
    torch.manual_seed(0)
    model = preset("tiny-llama")
    tokens = torch.randint(0, 128, (2, 8))
    stages = (Stage(index=0, layer_names=("embed", "layers.0")),
              Stage(index=1, layer_names=("layers.1", "layers.2", "layers.3", "norm", "head")))
    first, second = extract_stage(model, stages[0], first=True, last=False), \
        extract_stage(model, stages[1], first=False, last=True)
    assert list(first.layers.keys()) == ["0"] and first.head is None and second.embed is None
    with torch.no_grad():
        torch.testing.assert_close(second(first(tokens)), model(tokens))


def test_recompute_keeps_values_gradients_and_names() -> None:
    torch.manual_seed(0)
    model, tokens = preset("tiny-gpt"), torch.randint(0, 128, (1, 4))
    reference = preset("tiny-gpt")
    reference.load_state_dict(model.state_dict())
    modes = {"layers.1": Recompute.FULL, "layers.2": Recompute.SELECTIVE}
    apply_recompute(model, recompute_for=lambda name: modes.get(name, Recompute.NONE))
    kinds = [type(model.layers[i]).__name__ + "/" + type(model.layers[i].attn.core).__name__ for i in "012"]
    assert kinds == ["Block/AttentionCore", "CheckpointWrapper/AttentionCore", "Block/CheckpointWrapper"]
    model(tokens).sum().backward()
    reference(tokens).sum().backward()
    grads = {original_fqn(n): p.grad for n, p in model.named_parameters()}
    assert sorted(grads) == sorted(n for n, _ in reference.named_parameters())
    for name, param in reference.named_parameters():
        torch.testing.assert_close(grads[name], param.grad)


def test_plan_files_round_trip(tmp_path) -> None:
    path = tmp_path / "p.json"
    config = ParallelConfig(tp=2, pp=2, schedule="gpipe")
    write_plan(config, path, global_batch=16, seq_len=32)
    assert read_plan(path) == (config, 16, 32)
    assert read_plan(path, global_batch=8)[1] == 8
    estimate = Estimate(step_time_s=1.0, tokens_per_s=1.0, mfu=0.5, peak_mem_bytes=1, mem_capacity_bytes=2,
                        fits=True, breakdown=Breakdown())
    plan = Plan(config=config, estimate=estimate, model_name="tiny-gpt", cluster_name="x", num_devices=4,
                global_batch=16, seq_len=32, stages=even_stages(preset("tiny-gpt"), 2))
    write_plan(plan, path, global_batch=None, seq_len=None)
    assert read_plan(path) == (plan, 16, 32)
    path.write_text(json.dumps({"config": {"tp": 2}}))
    with pytest.raises(ValueError, match="--global-batch"):
        read_plan(path)


def test_torchrun_command_standalone_or_multi_node() -> None:
    single = torchrun_command(["--steps", "1"], nproc_per_node=4)
    assert "--standalone" in single and "--nproc-per-node=4" in single
    assert single[-3:] == ["autoplan.execute.worker", "--steps", "1"]
    multi = torchrun_command([], nproc_per_node=8, launcher_args=["--nnodes=2", "--rdzv-endpoint=h:29400"])
    assert "--standalone" not in multi and "--nnodes=2" in multi


def _error(tmp_path, rank: int, when: float, kind: str, message: str) -> None:
    (tmp_path / f"error-{rank}.json").write_text(json.dumps(
        {"rank": rank, "time": when, "type": kind, "message": message, "traceback": f"tb of {rank}"}))


TORCHRUN_SUMMARY = """Root Cause (first observed failure):
[0]:
  time      : 2026-11-29_19:19:56
  host      : localhost
  rank      : 3 (local_rank: 3)
  exitcode  : -9 (pid: 17967)  (SIGKILL)
"""


def test_diagnose_blames_the_rank_that_failed_on_its_own(tmp_path) -> None:
    _error(tmp_path, 0, 1.0, "RuntimeError", "[gloo] Connection closed by peer [127.0.0.1]:123")
    _error(tmp_path, 2, 2.0, "ValueError", "bad shape")
    rank, message = diagnose(str(tmp_path), TORCHRUN_SUMMARY)
    assert rank == 2 and message.startswith("rank 2 failed: ValueError: bad shape") and "tb of 2" in message


def test_diagnose_names_a_killed_rank_over_its_peers_errors(tmp_path) -> None:
    _error(tmp_path, 0, 1.0, "RuntimeError", "[gloo] Connection closed by peer [127.0.0.1]:123")
    assert diagnose(str(tmp_path), TORCHRUN_SUMMARY) == (
        3, ("rank 3 died: killed by signal SIGKILL (the process had no chance to report a Python traceback); "
            "the other ranks were stopped"))


def test_diagnose_quotes_a_native_abort_beside_the_signal(tmp_path) -> None:
    summary = TORCHRUN_SUMMARY.replace("-9 (pid: 17967)  (SIGKILL)", "-6 (pid: 17967)  (SIGABRT)")
    output = ("autoplan run: losses ['4.8'], step time 0.0075 s\nterminate called after throwing an instance of "
              "'gloo::IoException'\n  what():  [pair.cc:446] Connection closed\n" + summary)
    rank, message = diagnose(str(tmp_path), output)
    assert rank == 3 and message.startswith("rank 3 died: killed by signal SIGABRT")
    assert "terminate called after throwing an instance of 'gloo::IoException' /   what():  [pair.cc:446]" in message
    assert diagnose(str(tmp_path), summary)[1].endswith("traceback); the other ranks were stopped")


def test_diagnose_blames_the_hung_rank_not_the_ones_that_timed_out(tmp_path) -> None:
    for rank, stack in enumerate(["Thread 0x1 (most recent call first):\n  File worker.py, line 9 in hook", "", ""]):
        (tmp_path / f"stack-{rank}.txt").write_text(stack)
    _error(tmp_path, 1, 1.0, "DistBackendError", "Timed out waiting 30000ms for recv")
    _error(tmp_path, 2, 1.5, "DistBackendError", "Timed out waiting 30000ms for recv")
    rank, message = diagnose(str(tmp_path), "")
    assert rank == 0 and message.startswith("rank 0 hung: it reported no error") and "worker.py, line 9" in message
    (tmp_path / "stack-0.txt").write_text("")  # nobody was stopped: the first timeout is all there is
    rank, message = diagnose(str(tmp_path), "")
    assert rank == 1 and message.startswith("rank 1 failed: DistBackendError: Timed out")


def test_report_holds_losses_median_step_time_and_the_prediction() -> None:
    estimate = Estimate(step_time_s=0.5, tokens_per_s=1.0, mfu=0.5, peak_mem_bytes=7, mem_capacity_bytes=8,
                        fits=True, breakdown=Breakdown())
    plan = Plan(config=ParallelConfig(dp=2, zero=1), estimate=estimate, model_name="tiny-gpt", cluster_name="x",
                num_devices=2, global_batch=4, seq_len=8)
    result = TrainResult(losses=[3.0, 2.0, 1.0, 0.5], step_times_s=[9.0, 0.3, 0.1, 0.2], peak_mem_bytes=5)
    out = report(result, plan=plan, model_name="tiny-gpt", options=TrainOptions(steps=4, global_batch=4, seq_len=8),
                 peak_mem_per_rank=[5, 6], world_size=2)
    assert out["losses"] == [3.0, 2.0, 1.0, 0.5] and out["step_time_s"] == 0.2  # median of 0.3, 0.1, 0.2
    assert out["predicted_step_time_s"] == 0.5 and out["peak_mem_bytes_per_rank"] == [5, 6]
    assert out["plan"] == plan.config.to_dict() and out["zero_layout"]["shards_gradients"] is False
    assert json.loads(json.dumps(out)) == out
    assert "predicted_step_time_s" not in report(result, plan=plan.config, model_name="tiny-gpt",
                                                 options=TrainOptions(steps=4, global_batch=4, seq_len=8),
                                                 peak_mem_per_rank=[5, 6], world_size=2)


def test_tensor_parallel_degree_must_divide_heads_ffn_and_vocab() -> None:
    check_tensor_parallel(preset("tiny-llama"), 4)  # 8 heads, 4 kv heads, ffn 128, vocab 128
    with pytest.raises(ValueError, match=r"tp=8 does not divide the kv heads \(4\)"):
        check_tensor_parallel(preset("tiny-llama"), 8)


def test_the_executor_refuses_what_does_not_divide_before_building_anything() -> None:
    odd_vocab = preset_config("tiny-gpt", vocab_size=130)  # 130 = 2 x 5 x 13
    options = TrainOptions(steps=1, global_batch=8, seq_len=16)
    check_divides(odd_vocab, ParallelConfig(tp=2, dp=4), options)
    with pytest.raises(ValueError, match=r"tp=4 does not divide the vocabulary \(130\)"):
        check_divides(odd_vocab, ParallelConfig(tp=4, dp=2), options)
    with pytest.raises(ValueError, match=r"cp=8 needs seq_len divisible by 2\*cp=16"):
        check_divides(odd_vocab, ParallelConfig(cp=8), TrainOptions(steps=1, global_batch=8, seq_len=24))
    with pytest.raises(ValueError, match="5 pipeline stages but the model has 4 blocks"):
        check_divides(odd_vocab, ParallelConfig(pp=5), options)


def test_train_options_and_cli_reject_bad_input(capsys) -> None:
    with pytest.raises(ValueError, match="checkpoint"):
        TrainOptions(steps=2, global_batch=2, seq_len=4, save_every=1)
    assert main(["run", "--model", "tiny-gpt", "--steps", "1", "--plan", "p.json", "--tp", "2"]) == 2
    assert "either --plan or configuration flags" in capsys.readouterr().err
    assert main(["run", "--model", "tiny-gpt", "--steps", "1", "--tp", "2", "--nproc-per-node", "4",
                 "--dp", "1", "--global-batch", "4", "--seq-len", "8"]) == 2
    assert "needs pp*dp*ep*cp*tp = 2 ranks but --nproc-per-node is 4" in capsys.readouterr().err


def test_token_files_load_in_every_format_and_windows_follow_the_stream(tmp_path) -> None:
    """Windows are contiguous slices of the user's stream (checked by their first id: the stream is
    arange, so each row is start..start+seq_len), the same for the same (seed, step)."""
    import numpy as np

    from autoplan.execute.train import load_tokens, sample_windows

    stream = np.arange(500, dtype=np.uint16)
    paths = {".npy": tmp_path / "t.npy", ".bin": tmp_path / "t.bin", ".pt": tmp_path / "t.pt"}
    np.save(paths[".npy"], stream)
    stream.tofile(paths[".bin"])
    torch.save(torch.arange(500), paths[".pt"])
    for path in paths.values():
        tokens = load_tokens(str(path), vocab_size=512, seq_len=16)
        assert torch.equal(tokens, torch.arange(500))
    batch = sample_windows(tokens, 7, 3, global_batch=6, seq_len=16)
    assert batch.shape == (6, 17)
    assert torch.equal(batch, batch[:, :1] + torch.arange(17))
    assert int(batch.max()) < 500
    assert torch.equal(batch, sample_windows(tokens, 7, 3, global_batch=6, seq_len=16))
    assert not torch.equal(batch, sample_windows(tokens, 7, 4, global_batch=6, seq_len=16))


def test_bad_token_files_say_what_to_change(tmp_path) -> None:
    import numpy as np

    from autoplan.execute.train import load_tokens

    np.save(tmp_path / "big.npy", np.array([1, 2, 600] * 20))
    with pytest.raises(ValueError, match=r"token ids in \[1, 600\] but the model's vocabulary is 128"):
        load_tokens(str(tmp_path / "big.npy"), vocab_size=128, seq_len=8)
    np.save(tmp_path / "short.npy", np.arange(5))
    with pytest.raises(ValueError, match="holds 5 tokens: need at least seq_len \\+ 2 = 10"):
        load_tokens(str(tmp_path / "short.npy"), vocab_size=128, seq_len=8)
    with pytest.raises(ValueError, match="unknown format '.csv'"):
        load_tokens(str(tmp_path / "x.csv"), vocab_size=128, seq_len=8)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokens(str(tmp_path / "missing.npy"), vocab_size=128, seq_len=8)


def test_token_files_of_large_vocabularies_and_long_streams(tmp_path, monkeypatch) -> None:
    """.bin holds uint32 ids for vocabularies over 65,536 (Llama 3's 128,256); a stream longer than
    IN_MEMORY_TOKENS stays memory-mapped and yields the same windows as the in-memory copy."""
    import numpy as np

    from autoplan.execute import data

    ids = (np.arange(3000, dtype=np.uint32) * 41) % 128_256
    ids.tofile(tmp_path / "t.bin")
    tokens = data.load_tokens(str(tmp_path / "t.bin"), vocab_size=128_256, seq_len=16)
    assert torch.equal(tokens, torch.from_numpy(ids.astype(np.int64)))
    monkeypatch.setattr(data, "IN_MEMORY_TOKENS", 1000)
    mapped = data.load_tokens(str(tmp_path / "t.bin"), vocab_size=128_256, seq_len=16)
    assert isinstance(mapped, data.MappedTokens) and mapped.numel() == 3000
    assert torch.equal(data.sample_windows(mapped, 3, 1, global_batch=4, seq_len=16),
                       data.sample_windows(tokens, 3, 1, global_batch=4, seq_len=16))


def test_a_clean_rank_exits_0_without_interpreter_teardown(tmp_path) -> None:
    # gloo's threads can abort a finalizing interpreter (SIGABRT after a clean run): run_guarded skips teardown,
    # which an atexit handler, run only by teardown, shows; stdout is still flushed
    code = ("import atexit, sys\nfrom autoplan.execute.worker import run_guarded\n"
            "atexit.register(lambda: print('teardown ran'))\n"
            f"run_guarded({str(tmp_path)!r}, lambda rank: print('body ran', rank))\n")
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "RANK": "1"})
    assert done.returncode == 0 and done.stdout == "body ran 1\n", done.stdout + done.stderr
