"""The executor's pieces for models without tokens: their spec (sample shape and classes from the model), the
seeded images and labels and each replica's rows, the loss over [batch, classes] logits, BatchNorm scales
initialised to one, no vocabulary to split over tp, and --data refused for them before launch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autoplan.execute.images import image_batch, local_rows
from autoplan.execute.preflight import preflight
from autoplan.execute.source import model_spec
from autoplan.execute.train import cross_entropy
from autoplan.execute.weights import param_kind
from autoplan.plan.types import ParallelConfig


class _Meshes:
    def __init__(self, dp: int, ep: int = 0) -> None:
        self.ranks = {"dp": dp, "ep": ep}

    def rank_on(self, axis: str) -> int:
        return self.ranks.get(axis, 0)


def test_spec_of_a_vision_preset_records_its_input_and_classes() -> None:
    spec, _ = model_spec("resnet-tiny", seq_len=144)  # a stride-1 stem: 12 x 12 images
    assert (spec.name, spec.family, spec.input_shape, spec.num_outputs) == ("resnet-tiny", "module", (3, 12, 12), 10)
    assert spec.roles.block_paths == ("blocks.0", "blocks.1", "blocks.2", "blocks.3")
    token, _ = model_spec("tiny-gpt")
    assert token.input_shape == () and token.num_outputs == 0


def test_image_batches_are_seeded_and_split_by_replica() -> None:
    images, labels = image_batch(3, 1, global_batch=8, input_shape=(3, 4, 4), num_outputs=5)
    again = image_batch(3, 1, global_batch=8, input_shape=(3, 4, 4), num_outputs=5)
    assert torch.equal(images, again[0]) and torch.equal(labels, again[1])
    assert images.shape == (8, 3, 4, 4) and labels.min() >= 0 and labels.max() < 5
    assert not torch.equal(images, image_batch(3, 2, global_batch=8, input_shape=(3, 4, 4), num_outputs=5)[0])
    config = ParallelConfig(dp=2, ep=2)  # 4 replicas of 2 rows; replica = dp_rank * ep + ep_rank
    x, y = local_rows((images, labels), config, _Meshes(dp=1, ep=1))
    assert torch.equal(x, images[6:8]) and torch.equal(y, labels[6:8])


def test_the_loss_is_the_mean_over_samples_or_tokens() -> None:
    logits, labels = torch.randn(6, 10), torch.randint(0, 10, (6,))
    assert cross_entropy(logits, labels) == pytest.approx(F.cross_entropy(logits, labels).item())
    tokens, targets = torch.randn(2, 3, 7), torch.randint(0, 7, (2, 3))
    assert cross_entropy(tokens, targets) == pytest.approx(F.cross_entropy(tokens.reshape(6, 7), targets.reshape(6)).item())


def test_norm_scales_start_at_one_biases_at_zero() -> None:
    assert param_kind(nn.BatchNorm2d(4), "weight", (4,)) == "ones"
    assert param_kind(nn.BatchNorm2d(4), "bias", (4,)) == "zeros"
    assert param_kind(nn.GroupNorm(2, 4), "weight", (4,)) == "ones"
    assert param_kind(nn.Conv2d(3, 4, 3), "weight", (4, 3, 3, 3)) == "normal"


def test_no_vocabulary_to_split_over_tp() -> None:
    from autoplan.execute.tensor_parallel import vocab_parallel

    spec, meta = model_spec("vit-tiny", seq_len=64)
    assert spec.roles.vocab_size == 0 and vocab_parallel(spec.roles, meta, 2) == (False, False)


def test_a_token_file_for_an_image_model_is_refused_before_launch(tmp_path) -> None:
    spec, meta = model_spec("vit-tiny", seq_len=64)
    data = tmp_path / "tokens.npy"
    data.write_bytes(b"")
    with pytest.raises(ValueError, match=r"a token file, but vit-tiny takes inputs of shape \(3, 32, 32\)"):
        preflight(ParallelConfig(dp=2), spec, meta, global_batch=8, seq_len=64, data=str(data))
    with pytest.raises(ValueError, match="tp=2: no attention or MLP projections recognised in blocks.0"):
        preflight(ParallelConfig(tp=2), *model_spec("resnet-tiny", seq_len=64), global_batch=8, seq_len=64)
