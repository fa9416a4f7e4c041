"""The token stream a run trains on, and the batches every plan draws from it (torch and numpy only, so the
checks before launch read it without importing torch.distributed).

Formats: .npy (any integer dtype, memory-mapped), .bin (raw token ids as nanoGPT's prepare scripts write them:
uint16, which holds vocabularies up to 65,536; for larger ones, such as Llama 3's 128,256, uint32), .pt (a
tensor). Streams longer than IN_MEMORY_TOKENS stay memory-mapped: every rank shares the page cache and holds
only the windows of its steps, instead of an int64 copy of the whole file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TOKEN_FILE_FORMATS = {".npy": "numpy array of token ids",
                      ".bin": "raw token ids (nanoGPT's uint16; uint32 for vocabularies over 65,536)",
                      ".pt": "torch tensor of token ids"}
IN_MEMORY_TOKENS = 1 << 24  # 128 MiB as int64: below it the stream is copied into one int64 tensor
UINT16_VOCAB = 1 << 16


def step_generator(seed: int, step: int) -> torch.Generator:
    """The data generator of one step, the same under every plan."""
    # the CPU generator keeps 32 bits of its seed; distinct for seeds < 4294 and steps < 1000003
    return torch.Generator().manual_seed((seed * 1_000_003 + step) % 2**32)


def make_batch(seed: int, step: int, *, global_batch: int, seq_len: int, vocab_size: int) -> torch.Tensor:
    """Token ids [global_batch, seq_len + 1] of one step; inputs and targets are its shift by one."""
    generator = step_generator(seed, step)
    return torch.randint(0, vocab_size, (global_batch, seq_len + 1), generator=generator)


class MappedTokens:
    """A memory-mapped token stream; slices come back as int64 tensors."""

    def __init__(self, array: Any) -> None:
        self.array = array

    def numel(self) -> int:
        return int(self.array.size)

    def __getitem__(self, index: slice) -> torch.Tensor:
        import numpy as np

        return torch.from_numpy(np.asarray(self.array[index], dtype=np.int64))


def _read(path: str, suffix: str, vocab_size: int) -> Any:
    import numpy as np

    if suffix == ".npy":
        return np.load(path, mmap_mode="r").reshape(-1)
    if suffix == ".bin":
        return np.memmap(path, dtype=np.uint16 if vocab_size <= UINT16_VOCAB else np.uint32, mode="r")
    return torch.as_tensor(torch.load(path, weights_only=True)).long().flatten().numpy()


def load_tokens(path: str, *, vocab_size: int, seq_len: int) -> torch.Tensor | MappedTokens:
    """A user's token stream: a 1-D int64 tensor, or MappedTokens when longer than IN_MEMORY_TOKENS. Every id
    must be below the model's vocabulary, and the stream must hold at least one window of seq_len + 1 tokens."""
    import numpy as np

    suffix = Path(path).suffix
    if suffix not in TOKEN_FILE_FORMATS:
        known = ", ".join(f"{k} ({v})" for k, v in TOKEN_FILE_FORMATS.items())
        raise ValueError(f"data file {path!r}: unknown format {suffix!r}; use one of {known}")
    if not Path(path).is_file():
        raise FileNotFoundError(f"data file {path!r} does not exist")
    array = _read(path, suffix, vocab_size)
    if not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"data file {path!r} holds {array.dtype} values, not integer token ids")
    if array.size < seq_len + 2:
        raise ValueError(f"data file {path!r} holds {array.size} tokens: need at least seq_len + 2 = "
                         f"{seq_len + 2}; use a longer file or a shorter --seq-len")
    low, high = int(array.min()), int(array.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(f"data file {path!r} has token ids in [{low}, {high}] but the model's vocabulary is "
                         f"{vocab_size}: tokenize for this model or pick a model with a larger vocabulary")
    if array.size > IN_MEMORY_TOKENS:
        return MappedTokens(array)
    return torch.from_numpy(np.asarray(array, dtype=np.int64))


def sample_windows(tokens: torch.Tensor | MappedTokens, seed: int, step: int, *, global_batch: int,
                   seq_len: int) -> torch.Tensor:
    """[global_batch, seq_len + 1] windows of the token stream at offsets drawn from the same (seed, step)
    generator as make_batch, so every plan sees the same data."""
    generator = step_generator(seed, step)
    starts = torch.randint(0, tokens.numel() - seq_len - 1, (global_batch,), generator=generator)
    return torch.stack([tokens[int(i):int(i) + seq_len + 1] for i in starts])


__all__ = ["IN_MEMORY_TOKENS", "TOKEN_FILE_FORMATS", "MappedTokens", "load_tokens", "make_batch", "sample_windows",
           "step_generator"]
