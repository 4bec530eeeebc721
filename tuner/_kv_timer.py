"""Timing hooks of the quantised KV cache: how long each (de)quantisation took.

The serving job's instrumentation times the cache's codec through :class:`CodecTimer`; a plain
``callback(kind, seconds)`` works too (:func:`codec_timer` adapts it).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class CodecTimer(Protocol):
    """Times KV (de)quantisation; ``collectors.torch_serving.ServingInstrumentation`` is one."""

    def quantize(self, device: torch.device | None = None) -> contextlib.AbstractContextManager:
        ...

    def dequantize(self, device: torch.device | None = None) -> contextlib.AbstractContextManager:
        ...


TimeCallback = Callable[[str, float], None]
"""``callback(kind, seconds)`` with kind ``"quantize"`` or ``"dequantize"``."""


class _CallbackTimer:
    """Adapts a callback to :class:`CodecTimer` (CUDA is synchronised around the block)."""

    def __init__(self, callback: TimeCallback) -> None:
        self._callback = callback

    @contextlib.contextmanager
    def _timed(self, kind: str, device: torch.device | None) -> Iterator[None]:
        cuda = device is not None and torch.device(device).type == "cuda"
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        yield
        if cuda:
            torch.cuda.synchronize(device)
        self._callback(kind, time.perf_counter() - start)

    def quantize(self, device: torch.device | None = None) -> contextlib.AbstractContextManager:
        return self._timed("quantize", device)

    def dequantize(self, device: torch.device | None = None) -> contextlib.AbstractContextManager:
        return self._timed("dequantize", device)


class _NullTimer:
    def quantize(self, device: torch.device | None = None) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def dequantize(self, device: torch.device | None = None) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


def codec_timer(timer: CodecTimer | TimeCallback | None) -> CodecTimer:
    """``timer`` as a :class:`CodecTimer`: a callback is adapted, None times nothing."""
    return (_NullTimer() if timer is None
            else timer if isinstance(timer, CodecTimer) else _CallbackTimer(timer))
