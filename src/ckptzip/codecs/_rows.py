"""What the compiled CPU coders (``_gdeflate.c``, ``_ckzhuff.c``) take: chunks as rows of raw
addresses into tensors whose bounds are checked here first, since the C side trusts them."""

from __future__ import annotations

import numpy as np
import torch

from ..errors import CorruptChunkError


def addresses(tensor: torch.Tensor, offsets: np.ndarray) -> np.ndarray:
    """The addresses of ``tensor``'s bytes at ``offsets``."""
    out: np.ndarray = offsets.astype(np.uint64) + np.uint64(tensor.data_ptr())
    return out


def check_bounds(codec: str, what: str, tensor: torch.Tensor, offsets: np.ndarray, lengths: np.ndarray) -> None:
    """``ValueError`` unless ``tensor`` is a 1-D contiguous uint8 CPU tensor holding every chunk."""
    if tensor.dtype != torch.uint8 or tensor.dim() != 1 or not tensor.is_contiguous() or tensor.is_cuda:
        raise ValueError(f"{codec} (cpu) takes 1-D contiguous torch.uint8 CPU tensors; {what} is not one")
    if offsets.shape != lengths.shape or (offsets < 0).any() or (offsets + lengths > tensor.numel()).any():
        raise ValueError(f"{codec} (cpu): a {what} chunk lies outside its buffer")


def corrupt(codec: str, index: int, what: str) -> CorruptChunkError:
    """The error of chunk ``index`` of a decode call: ``what`` is wrong with it."""
    return CorruptChunkError(f"{codec} chunk {index} {what}", index)
