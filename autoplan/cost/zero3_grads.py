"""Where DeepSpeed stage 3's gradient hooks flush the reduce buckets (engine field zero3_small_grad_hooks):
stage3.py (v0.3.13-v0.5.x, read at 29b444b6c) create_reduce_and_remove_grad_hooks registers a hook on every
parameter's AccumulateGrad, the persistent (small) ones included, and each hook runs
reduce_independent_p_g_buckets_and_remove_grads: `if self.elements_in_ipg_bucket + param.ds_numel >
self.reduce_bucket_size: self.reduce_ipg_grads()`, then the gradient joins the bucket. So a bias's or a
LayerNorm's gradient can flush a bucket of weight gradients, and when it fires decides what the reduction
runs beside. Used by cost/deepspeed.py (_backward_steps) and the quick estimate (fetch_wait_share)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

# A Megatron GPT block's small parameters in the order cost.deepspeedrank.layer_small_numels lists them
# (forward order): LayerNorm 1 weight and bias, the QKV bias, the projection bias, LayerNorm 2 weight and
# bias, the first and the second MLP bias.
GPT_SMALL = ("ln1.weight", "ln1.bias", "qkv.bias", "proj.bias", "ln2.weight", "ln2.bias", "fc1.bias", "fc2.bias")


Hooks = tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]  # (before its fetch, with its weight, after)


def block_hooks(numels: Sequence[float], small: Sequence[float]) -> list[Hooks] | None:
    """gpt_grad_hooks(small) for a layer that is a Megatron GPT block (its four weight modules in `numels`, its
    small parameters in GPT_SMALL's order in `small`), else None: the one test of which layers' small
    gradients join the buckets at gpt_grad_hooks' places (cost/deepspeed.py block_modules, fetch_wait_share)."""
    if len(small) != len(GPT_SMALL) or len(numels) != 4:
        return None
    return gpt_grad_hooks(small)


def gpt_grad_hooks(small: Sequence[float]) -> list[Hooks]:
    """Where the gradient hooks of a Megatron GPT block's small parameters (`small` in GPT_SMALL order) fire
    in the backward, per weight module (QKV, projection, fc1, fc2): (before its fetch, with its weight,
    after its backward). stage3.py create_reduce_and_remove_grad_hooks hooks every parameter's
    AccumulateGrad, persistent ones included, and autograd runs an AccumulateGrad as soon as its gradient
    is ready (torch/csrc/autograd/function.h NOTE [Sequence Number]: sequence_nr UINT64_MAX). Megatron's
    layer (megatron/model/transformer.py, fda81a21 as Megatron-LM a8d172b3): the projection, fc1 and fc2
    are built with skip_bias_add=True and return their bias Parameter, which stage3.py
    _apply_to_tensors_only passes by (`type(outputs) is torch.Tensor` is False for a Parameter): its
    gradient comes from bias_dropout_add's / bias_gelu's backward before the module's PreBackwardFunction
    fetches the weight; LayerNorm 2's from its backward, between fc1's and the projection's; the QKV bias
    from F.linear with the weight (mpu/layers.py ColumnParallelLinear, skip_bias_add False); LayerNorm
    1's after QKV's backward, before the next layer's recompute fetches."""
    ln1w, ln1b, qkv_b, proj_b, ln2w, ln2b, fc1_b, fc2_b = small
    return [((), (qkv_b,), (ln1w, ln1b)), ((ln2w, ln2b, proj_b), (), ()), ((fc1_b,), (), ()), ((fc2_b,), (), ())]


@dataclass(slots=True, kw_only=True)
class Bucket:
    """The gradient bucket being filled (stage3.py elements_in_ipg_bucket)."""

    limit: float
    reduce_s: Callable[[float], float]
    single_s: Callable[[float], float] | None = None  # a bucket of one gradient, where it costs less
    numel: float = 0.0
    tensors: int = 0

    def arrive(self, numels: Sequence[float]) -> tuple[float, ...]:
        """The reductions (seconds) the hooks of these gradients issue, in order: each reduces the bucket
        it would overflow (an empty bucket reduces nothing), then joins the next."""
        out = []
        for n in numels:
            if self.numel > 0 and self.numel + n > self.limit:
                out.append(self.flush())
            self.numel, self.tensors = self.numel + n, self.tensors + 1
        return tuple(out)

    def layer_backward(self, modules: Sequence[tuple[float, Hooks]]) -> list[tuple[int, Hooks]]:
        """A layer's backward through its weight modules (numel, hooks) in reverse order: per module, its
        index and the reductions its gradients' hooks issue (before its fetch: its `before` hooks; with its
        compute: its weight's, then its `with` hooks; after it: its `after` hooks)."""
        out = []
        for mi in reversed(range(len(modules))):
            numel, (before, with_, after) = modules[mi]
            out.append((mi, (self.arrive(before), self.arrive((numel, *with_)), self.arrive(after))))
        return out

    def flush(self) -> float:
        """The bucket's reduction (seconds); it is empty after."""
        one = self.tensors == 1 and self.single_s is not None
        seconds = self.single_s(self.numel) if one else self.reduce_s(self.numel)
        self.numel, self.tensors = 0.0, 0
        return seconds


def fetch_wait_share(numels: Sequence[float], small: Sequence[float], limit: float) -> float:
    """Share of a GPT block's gradient elements (steady state: the third of three equal blocks) whose
    bucket a small gradient's hook flushes just before a module's fetch (gpt_grad_hooks' `before` hooks),
    so that its reduction runs while the host waits for the gather rather than beside a module's
    backward (Bucket.layer_backward, as cost/deepspeed.py _backward_steps walks it). 0 for a layer that is
    not a GPT block (block_hooks)."""
    hooks = block_hooks(numels, small)
    if hooks is None:
        return 0.0
    bucket = Bucket(limit=limit, reduce_s=lambda n: n)
    for _ in range(3):
        before = total = 0.0
        for _, (flushed, during, after) in bucket.layer_backward(list(zip(numels, hooks))):
            rest = (*during, *after)
            before, total = before + sum(flushed), total + sum(flushed) + sum(rest)
    return before / total if total > 0 else 0.0
