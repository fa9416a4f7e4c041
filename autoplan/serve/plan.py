"""A ranked serving plan: its config, estimate and workload, the SLO verdict, a one-paragraph explanation
and the launch commands for vLLM and SGLang (`vllm serve ...`, `python -m sglang.launch_server ...`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from autoplan.serve.types import ServeConfig, ServeEstimate, Workload

# Hugging Face ids of the presets, for the launch commands (any other model name is passed through)
HF_IDS = {
    "llama3-8b": "meta-llama/Meta-Llama-3-8B-Instruct",
    "llama3-70b": "meta-llama/Meta-Llama-3-70B-Instruct",
    "llama3-405b": "meta-llama/Llama-3.1-405B-Instruct",
    "mixtral-8x7b": "mistralai/Mixtral-8x7B-Instruct-v0.1",
    "deepseek-v3": "deepseek-ai/DeepSeek-V3",
    "llava-1.5-7b": "llava-hf/llava-1.5-7b-hf",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class ServePlan:
    config: ServeConfig
    estimate: ServeEstimate
    workload: Workload
    model_name: str
    cluster_name: str
    engine_name: str
    meets_slo: bool = True
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None

    def _model_id(self, model_id: str | None) -> str:
        return model_id or HF_IDS.get(self.model_name, self.model_name)

    def vllm_args(self, model_id: str | None = None) -> dict[str, tuple[str, ...]]:
        """`vllm serve` arguments per role: {"serve": ...} aggregated (replicas as --data-parallel-size),
        {"prefill": ..., "decode": ...} disaggregated (one instance each, NixlConnector KV transfer)."""
        c = self.config
        base = ("vllm", "serve", self._model_id(model_id), "--max-num-seqs", str(c.max_batch))
        if c.ep > 1:
            base += ("--enable-expert-parallel",)
        if not c.disaggregated:
            return {"serve": base + _layout_flags(c.tp, c.pp, "--tensor-parallel-size", "--pipeline-parallel-size")
                    + (("--data-parallel-size", str(c.replicas)) if c.replicas > 1 else ())}
        kv = ("--kv-transfer-config", '{"kv_connector":"NixlConnector","kv_role":"kv_both"}')
        return {"prefill": base + _layout_flags(c.prefill_tp, c.prefill_pp, "--tensor-parallel-size",
                                                "--pipeline-parallel-size") + kv,
                "decode": base + _layout_flags(c.tp, c.pp, "--tensor-parallel-size", "--pipeline-parallel-size") + kv}

    def sglang_args(self, model_id: str | None = None) -> dict[str, tuple[str, ...]]:
        """`python -m sglang.launch_server` arguments per role (as vllm_args; --disaggregation-mode)."""
        c = self.config
        base = ("python", "-m", "sglang.launch_server", "--model-path", self._model_id(model_id),
                "--max-running-requests", str(c.max_batch))
        if c.ep > 1:
            base += ("--ep-size", str(c.ep))
        if not c.disaggregated:
            return {"serve": base + _layout_flags(c.tp, c.pp, "--tp-size", "--pp-size")
                    + (("--dp-size", str(c.replicas)) if c.replicas > 1 else ())}
        return {"prefill": base + _layout_flags(c.prefill_tp, c.prefill_pp, "--tp-size", "--pp-size")
                + ("--disaggregation-mode", "prefill"),
                "decode": base + _layout_flags(c.tp, c.pp, "--tp-size", "--pp-size")
                + ("--disaggregation-mode", "decode")}

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.config.to_dict(), "estimate": self.estimate.to_dict(),
                "workload": asdict(self.workload), "model": self.model_name, "cluster": self.cluster_name,
                "engine": self.engine_name, "meets_slo": self.meets_slo, "ttft_slo_s": self.ttft_slo_s,
                "tpot_slo_s": self.tpot_slo_s,
                "launch": {"vllm": {k: list(v) for k, v in self.vllm_args().items()},
                           "sglang": {k: list(v) for k, v in self.sglang_args().items()}}}

    def explain(self) -> str:
        c, e, w = self.config, self.estimate, self.workload
        load = f"{w.concurrency} concurrent clients" if w.concurrency is not None else f"{w.rate:g} requests/s"
        layout = describe(c)
        lines = [(f"{self.model_name} on {c.num_devices} x {self.cluster_name} with {self.engine_name}: {layout}, "
                 f"{load}, {w.input_len} in / {w.output_len} out tokens.")]
        lines.append(f"TTFT {e.ttft_s * 1e3:.1f} ms (queue {e.queue_s * 1e3:.1f} ms"
                     + (f", KV transfer {e.kv_transfer_s * 1e3:.2f} ms" if c.disaggregated else "")
                     + f"), TPOT {e.tpot_s * 1e3:.2f} ms ({e.tokens_per_s_per_user:.0f} tokens/s per user), "
                     f"{e.tokens_per_s:,.0f} tokens/s = {e.tokens_per_s_per_gpu:,.0f} per GPU.")
        if e.encode_s or c.encoder_replicas:
            where = (f"on {c.encoder_replicas} encoder instance(s) of tp{c.encoder_tp} (queue "
                     f"{e.encode_queue_s * 1e3:.2f} ms, hand-off to prefill {e.encoder_handoff_s * 1e3:.3f} ms)"
                     if c.encoder_replicas else "on the prefill devices, sharded over their tp")
            lines.append(f"Encode: {w.images_per_request} image(s) per request, {e.encode_s * 1e3:.2f} ms {where}; "
                         f"part of TTFT.")
        lines.append(f"Memory per GPU: weights {e.weight_bytes_per_gpu / 2**30:.1f} GiB, KV pool "
                     f"{e.kv_cache_bytes_per_gpu / 2**30:.1f} GiB ({e.max_concurrency} requests at once), "
                     f"peak {e.peak_mem_bytes / 2**30:.1f} of {e.mem_capacity_bytes / 2**30:.0f} GiB.")
        if e.breakdown:
            total = sum(v for _, v in e.breakdown) or 1.0
            top = sorted(e.breakdown, key=lambda kv: -kv[1])[:3]
            lines.append("A decode step: " + ", ".join(f"{k} {v / total:.0%}" for k, v in top) + ".")
        if self.ttft_slo_s or self.tpot_slo_s:
            verdict = "meets" if self.meets_slo else "MISSES"
            lines.append(f"It {verdict} the SLO (TTFT <= {self.ttft_slo_s or 'any'} s, TPOT <= {self.tpot_slo_s or 'any'} s).")
        lines += list(e.notes)
        return "\n".join(lines)


def describe(c: ServeConfig) -> str:
    """A short layout string: "tp4 x 2 replicas, batch <= 256" or "P 2 x tp2 : D 1 x tp4" (with
    "E 1 x tp1 + " in front for an encoder on instances of its own)."""
    inst = f"tp{c.tp}" + (f" pp{c.pp}" if c.pp > 1 else "") + (f" ep{c.ep}" if c.ep > 1 else "")
    enc = f"E {c.encoder_replicas} x tp{c.encoder_tp} + " if c.encoder_replicas else ""
    if c.disaggregated:
        pre = f"tp{c.prefill_tp}" + (f" pp{c.prefill_pp}" if c.prefill_pp > 1 else "")
        return f"{enc}disaggregated P {c.prefill_replicas} x {pre} : D {c.replicas} x {inst}, batch <= {c.max_batch}"
    return f"{enc}{c.replicas} x {inst}, batch <= {c.max_batch}"


def _layout_flags(tp: int, pp: int, tp_flag: str, pp_flag: str) -> tuple[str, ...]:
    return (tp_flag, str(tp)) + ((pp_flag, str(pp)) if pp > 1 else ())
