"""Serving engine profiles as files: engines/serve/<name>.yaml -> ServeEngine, by name or path, with
the cluster profiles' validation (autoplan.cluster.load: unknown fields with a close match, numbers,
one line per mistake).

Fields (schema_version 1; every value carries its source in a YAML comment):
  name, description
  memory_fraction        share of device memory the engine may use (vLLM gpu_memory_utilization,
                         TensorRT-LLM free_gpu_memory_fraction; SGLang: see reserve_buckets)
  memory_fraction_of     "total" (of device memory) or "free" (of what weights and activations leave)
  reserve_buckets        [[max_mem_bytes, base_bytes, per_rank_bytes], ...]: SGLang's reserved memory
                         by device size; static fraction = (mem - base - per_rank x tp x pp) / mem
  workspace_bytes        non-KV buffers besides activations
  kv_block_tokens        tokens per KV-cache page
  max_num_seqs, max_num_batched_tokens   batch cap and per-iteration token budget (chunked prefill)
  large_gpu_min_mem_bytes, large_gpu_exclude, large_gpu_max_num_seqs, large_gpu_max_num_batched_tokens
                         bigger defaults on big GPUs (vLLM EngineArgs.get_batch_defaults)
  chunked_prefill        whether prefill chunks share iterations with decodes
  cuda_graph_max_batch   decode batches replayed as CUDA graphs; 0 = eager (host-bound below)
  kernels_per_block, kernel_launch_s   kernels one block launches (besides all-reduces) and the fixed
                         time each adds (launch and dependency gap), on top of its roofline time
  quant_kernels_per_block   extra kernels per block that quantize activations for 8-bit GEMMs
  gemm_bw_efficiency, gemm_bw_efficiency_8bit   achieved share of datasheet bandwidth of the engine's
                         decode GEMMs (small M, weights streamed once) for 16-bit and 8-bit weights
  decode_attention_tensor_cores   whether decode attention uses tensor cores (else the fp32 peak)
  step_overhead_s, step_overhead_per_seq_s   exposed host time per iteration, and per running sequence
  allreduce_table        {tp: [[bytes, seconds], ...]} measured custom all-reduce latencies
  custom_allreduce_max_bytes   largest message the custom all-reduce takes (NCCL above)
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from autoplan.cluster.load import _check_keys, _number, named_yaml, profile_dirs, read_profile, shipped_yaml
from autoplan.serve.types import ServeEngine

SCHEMA_VERSION = 1
DEFAULT_ENGINE = "vllm"
_REQUIRED = ("schema_version", "name", "memory_fraction", "memory_fraction_of")
_INTS = ("kv_block_tokens", "max_num_seqs", "max_num_batched_tokens", "large_gpu_max_num_seqs",
         "large_gpu_max_num_batched_tokens", "cuda_graph_max_batch", "kernels_per_block",
         "quant_kernels_per_block")
_FLOATS = ("workspace_bytes", "large_gpu_min_mem_bytes", "step_overhead_s", "step_overhead_per_seq_s", "kernel_launch_s",
           "custom_allreduce_max_bytes")
_FRACTIONS = ("gemm_bw_efficiency", "gemm_bw_efficiency_8bit")
_BOOLS = ("chunked_prefill", "decode_attention_tensor_cores")


def engine_dirs() -> tuple[Path, ...]:
    """Where shipped engine profiles live: engines/serve beside each profiles directory (the source
    checkout, then the wheel's data directory, <prefix>/share/autoplan/engines/serve)."""
    return tuple(dict.fromkeys(p.parent / "engines" / "serve" for p in profile_dirs()))


def engine_names() -> tuple[str, ...]:
    return tuple(sorted(shipped_yaml(engine_dirs())))


def engine_path(name_or_path: str | os.PathLike[str]) -> Path:
    """The file a shipped engine name or a YAML path refers to (cluster.load.named_yaml: one line with a
    close match otherwise)."""
    return named_yaml(name_or_path, engine_dirs(), "serving engine")


def load_engine(name_or_path: str | os.PathLike[str] | ServeEngine | None = None) -> ServeEngine:
    """A ServeEngine from a shipped name ("vllm", "sglang", "tensorrt-llm"), a YAML path, or itself."""
    if isinstance(name_or_path, ServeEngine):
        return name_or_path
    path = engine_path(DEFAULT_ENGINE if name_or_path is None else name_or_path)
    return parse_engine(read_profile(path), str(path))


def parse_engine(data: Any, path: str) -> ServeEngine:
    """Validate one engine mapping (as read from YAML) and build the ServeEngine."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{path}: an engine profile is a mapping of fields, got {type(data).__name__}")
    fields = tuple(f.name for f in dataclasses.fields(ServeEngine) if f.name != "source")
    optional = tuple(f for f in fields if f not in _REQUIRED)
    _check_keys(data, _REQUIRED, optional, "", path)
    if data["schema_version"] != SCHEMA_VERSION:
        raise ValueError(f"{path}: schema_version {data['schema_version']!r} is not supported (this autoplan "
                         f"reads {SCHEMA_VERSION})")
    values: dict[str, Any] = {"name": str(data["name"]), "source": path}
    values["description"] = str(data.get("description", ""))
    values["memory_fraction"] = _fraction(data["memory_fraction"], "memory_fraction", path)
    of = str(data["memory_fraction_of"])
    if of not in ("total", "free"):
        raise ValueError(f"{path}: memory_fraction_of must be 'total' or 'free', got {of!r}")
    values["memory_fraction_of"] = of
    for key in _INTS:
        if key in data:
            values[key] = int(_number(data[key], key, path, allow_zero=True))
    for key in _FLOATS:
        if key in data:
            values[key] = _number(data[key], key, path, allow_zero=True)
    for key in _FRACTIONS:
        if key in data:
            values[key] = _fraction(data[key], key, path)
    for key in _BOOLS:
        if key in data:
            if not isinstance(data[key], bool):
                raise ValueError(f"{path}: {key} must be true or false, got {data[key]!r}")
            values[key] = data[key]
    values["large_gpu_exclude"] = tuple(str(s) for s in data.get("large_gpu_exclude") or ())
    values["reserve_buckets"] = _rows(data.get("reserve_buckets") or (), 3, "reserve_buckets", path)
    values["allreduce_table"] = _table(data.get("allreduce_table") or {}, path)
    return ServeEngine(**values)


def _fraction(value: Any, key: str, path: str) -> float:
    number = _number(value, key, path)
    if number > 1:
        raise ValueError(f"{path}: field {key!r} is a fraction and must be in (0, 1], got {value!r}")
    return number


def _rows(rows: Any, width: int, key: str, path: str) -> tuple[tuple[float, ...], ...]:
    if not isinstance(rows, (list, tuple)):
        raise ValueError(f"{path}: field {key!r} must be a list of [{width} numbers] rows, got {rows!r}")
    out = []
    for row in rows:
        if not isinstance(row, (list, tuple)) or len(row) != width:
            raise ValueError(f"{path}: every row of {key!r} must hold {width} numbers, got {row!r}")
        out.append(tuple(_number(x, key, path, allow_zero=True) for x in row))
    return tuple(out)


def _table(table: Any, path: str) -> tuple[tuple[int, tuple[tuple[float, float], ...]], ...]:
    if not isinstance(table, Mapping):
        raise ValueError(f"{path}: allreduce_table must map a tp size to [[bytes, seconds], ...], got {table!r}")
    out = []
    for tp, rows in sorted(table.items(), key=lambda kv: int(kv[0])):
        points = tuple(sorted(_rows(rows, 2, f"allreduce_table.{tp}", path)))
        if len(points) < 2:
            raise ValueError(f"{path}: allreduce_table.{tp} needs at least two [bytes, seconds] points")
        out.append((int(tp), points))  # type: ignore[arg-type]
    return tuple(out)
