"""The fused CPU dequantiser (``tuner/csrc/kv_dequant.c``), built on first use and cached.

Built and loaded by :func:`collectors.load_native` (a C compiler, no torch headers, so the
torch-free sidecar never touches it). Without a compiler, or with ``SEEDANCE_KV_NATIVE=0``,
:func:`dequantize_into` answers False and the cache uses the torch reference path
(``tuner._kv_codec``), which the tests check this kernel against bit for bit.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from collectors import NATIVE_FLAGS, load_native

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "kv_dequant.c"
FLAGS = (*NATIVE_FLAGS, "-ffp-contract=off")
"""``-ffp-contract=off``: no fused multiply-add, so results match torch's addcmul bit for bit."""


@functools.cache
def library() -> Callable[..., int] | None:
    """The loaded kernel, or None (logged once) when it is turned off or cannot be built."""
    return load_native(SOURCE, "seedance_kv_dequantize",
                       [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                        ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                        ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int],
                       flags=FLAGS, switch="SEEDANCE_KV_NATIVE", log=log,
                       fallback="the KV cache dequantises with the slower torch path")


def dequantize_into(out: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                    zero: torch.Tensor | None, bits: int, *, keys: bool, group: int,
                    simd: bool = True) -> bool:
    """Write the float32 reconstruction of one stored part into ``out`` [b, h, t, d] (a view
    whose (b, h) blocks are evenly spaced rows of ``d``); False, with ``out`` untouched, when
    the kernel is unavailable or the tensors are not on the CPU. ``simd=False`` takes the
    portable path that CPUs without AVX2 run. Called per stored part on every decode step,
    so it checks with the cheapest tensor calls."""
    kernel = library()
    if kernel is None or out.dtype is not torch.float32 or out.is_cuda or packed.is_cuda \
            or scale.dtype is not torch.float16:
        return False
    b, h, t, d = out.shape
    blocks, block, row, one = out.stride()
    if one != 1 or row != d or blocks != h * block:
        return False
    parts = [x if x.is_contiguous() else x.contiguous() for x in (packed, scale)]
    if zero is not None:  # float16 like the scale: the kernel reads their bits
        parts.append(zero if zero.is_contiguous() else zero.contiguous())
    status = kernel(
        parts[0].data_ptr(), parts[1].data_ptr(), parts[2].data_ptr() if zero is not None
        else None, bits, keys, group, b * h, t, d, out.data_ptr(), block, simd)
    return status == 0
