"""The fused CPU dequantiser (``tuner/csrc/kv_dequant.c``), built on first use and cached.

Plain C loaded through ctypes: it needs a C compiler (``$CC``, else ``cc`` or ``gcc``) but no
torch headers, so it builds in about a second and the torch-free sidecar never touches it.
The build lands in ``$SEEDANCE_CACHE_DIR`` (default ``~/.cache/seedance-tuner``) under a name
hashed from the source, compiler and flags, written to a temporary file and renamed, so jobs
starting together never load half a library. Without a compiler, or with
``SEEDANCE_KV_NATIVE=0``, :func:`dequantize_into` answers False and the cache uses the torch
reference path (``tuner._kv_codec``), which the tests check this kernel against bit for bit.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "kv_dequant.c"
FLAGS = ("-O3", "-ffp-contract=off", "-fPIC", "-shared", "-fvisibility=hidden")
"""``-ffp-contract=off``: no fused multiply-add, so results match torch's addcmul bit for bit."""


def _cache_dir() -> Path:
    env = os.environ.get("SEEDANCE_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "seedance-tuner"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


def _build(compiler: str) -> Path:
    """The library for this source, compiler and flags: from the cache, or compiled into it."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             check=True, timeout=30).stdout
    digest = hashlib.sha256(SOURCE.read_bytes() + version.encode() + " ".join(FLAGS).encode())
    target = _cache_dir() / f"kv_dequant-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, prefix=".kv_dequant-", suffix=".so")
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, "-o", partial, str(SOURCE)], capture_output=True,
                       text=True, check=True, timeout=120)
        os.replace(partial, target)
    finally:
        Path(partial).unlink(missing_ok=True)
    return target


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel, or None (logged once) when it is turned off or cannot be built."""
    if os.environ.get("SEEDANCE_KV_NATIVE", "1") == "0":
        return None
    compiler = _compiler()
    if compiler is None:
        log.warning("no C compiler (set $CC): the KV cache dequantises with the slower torch "
                    "path")
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.SubprocessError) as e:
        said = (str(getattr(e, "stderr", "") or "").strip().splitlines() or [str(e)])[-1]
        log.warning("building %s failed, the KV cache dequantises with the slower torch "
                    "path: %s", SOURCE.name, said)
        return None
    fn = lib.seedance_kv_dequantize
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                   ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    return lib


def dequantize_into(out: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                    zero: torch.Tensor | None, bits: int, *, keys: bool, group: int,
                    simd: bool = True) -> bool:
    """Write the float32 reconstruction of one stored part into ``out`` [b, h, t, d] (a view
    whose (b, h) blocks are evenly spaced rows of ``d``); False, with ``out`` untouched, when
    the kernel is unavailable or the tensors are not on the CPU. ``simd=False`` takes the
    portable path that CPUs without AVX2 run. Called per stored part on every decode step,
    so it checks with the cheapest tensor calls."""
    lib = library()
    if lib is None or out.dtype is not torch.float32 or out.is_cuda or packed.is_cuda \
            or scale.dtype is not torch.float16:
        return False
    b, h, t, d = out.shape
    blocks, block, row, one = out.stride()
    if one != 1 or row != d or blocks != h * block:
        return False
    parts = [x if x.is_contiguous() else x.contiguous() for x in (packed, scale)]
    if zero is not None:  # float16 like the scale: the kernel reads their bits
        parts.append(zero if zero.is_contiguous() else zero.contiguous())
    status = lib.seedance_kv_dequantize(
        parts[0].data_ptr(), parts[1].data_ptr(), parts[2].data_ptr() if zero is not None
        else None, bits, keys, group, b * h, t, d, out.data_ptr(), block, simd)
    return status == 0
