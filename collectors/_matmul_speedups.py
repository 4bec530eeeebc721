"""What each dtype's matmul buys on this device: a micro-benchmark, cached per device model.

The input of the compute-aware priors next to the forward profile: a precision is worth trying
only where its matmuls are measured faster than fp32 (``tuner.job`` bars the slower ones).
Imports torch, so only a job imports it (through ``collectors.torch_profile``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

log = logging.getLogger(__name__)

PRECISION_DTYPES: Mapping[str, torch.dtype] = MappingProxyType({
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.float8_e4m3fn,
})
"""Keys of :func:`dtype_speedups` (the ``precision.<group>`` knob values) -> torch dtypes."""

FAST_SPEEDUP = 1.1
"""A precision counts as fast on a device where its matmuls measured at least this much faster
than fp32's: the casts around a group and the numerical risk eat a smaller gain, and the
one-core micro-benchmark reads a few percent either way (fp16 at 1.01x on a CPU with
AVX512-FP16). The search tries only fast precisions; a job's fingerprint names them."""

CACHE_ENV = "SEEDANCE_CACHE_DIR"
_CACHE_FILE = "matmul_speedups.json"

_SIZES = (64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
"""Square matmul sizes tried, smallest first (multiples of 16, as fp8 matmuls need)."""
_TARGET_S = 1e-3  # grow until an fp32 matmul takes this long ...
_SLOWEST_CAP_S = 0.02  # ... or the slowest dtype takes this long (fp16 on a CPU: 20-100x fp32)
_ROUNDS = 5
_SAMPLE_S = 0.01  # a sample repeats a call (up to 3 in all) while under this
_BUDGET_S = 0.6  # the timed rounds stop after this much, once each dtype has one sample


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: how metrics name a dtype."""
    return str(dtype).removeprefix("torch.")


def device_model(device: torch.device | str) -> str:
    """The device's model name: the GPU's name, or the CPU's from /proc/cpuinfo."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "Hardware") and value.strip():
                return value.strip()
    return platform.processor() or platform.machine() or "cpu"


def _cache_key(device: torch.device) -> str:
    """What a measurement depends on besides the device: torch and the fp32 matmul mode."""
    return "|".join([device.type, device_model(device), f"torch={torch.__version__}",
                     f"fp32_matmul={torch.get_float32_matmul_precision()}"])


def _cache_path(cache_dir: str | os.PathLike[str] | None) -> Path:
    if cache_dir is None:
        cache_dir = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "seedance-tuner"
    return Path(cache_dir) / _CACHE_FILE


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        log.warning("matmul speedup cache %s is unreadable; measuring again", path)
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(path: Path, data: dict[str, Any]) -> None:
    """Write-then-rename, so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.",
                                     delete=False) as tmp:
        json.dump(data, tmp, indent=1, sort_keys=True)
    os.replace(tmp.name, path)


def dtype_speedups(device: torch.device | str, *,
                   cache_dir: str | os.PathLike[str] | None = None) -> dict[str, float]:
    """Each dtype's square-matmul speed on ``device`` relative to fp32 (``{"fp32": 1.0, ...}``).

    Keys are precision knob values: ``fp32``, ``bf16``, ``fp16`` (absent where a matmul in it
    fails) and ``fp8`` (only on CUDA devices with scaled fp8 matmuls, compute capability 8.9+).
    Measured once per device model, torch version and fp32 matmul precision, then read from
    ``matmul_speedups.json`` under ``cache_dir`` (default ``$SEEDANCE_CACHE_DIR``
    or ``~/.cache/seedance-tuner``). A cold run takes well under a second on a 2-core CPU; it
    competes with whatever else the device runs, so call it before training starts.

    A CPU is measured on one thread, i.e. per core: on a shared box, multi-threaded matmuls
    wait for descheduled worker threads (a 0.3 ms fp32 matmul on 2 threads took 12-40 ms under
    load here, which made bf16, 50x slower, read 70x faster), and the cache keeps what the
    device can do, not how busy it was.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    path, key = _cache_path(cache_dir), _cache_key(device)
    cached = _read_cache(path).get(key)
    if isinstance(cached, dict) and isinstance(cached.get("speedups"), dict):
        return {str(k): float(v) for k, v in cached["speedups"].items()}
    speedups, size = _benchmark(device)
    entry = {"speedups": speedups, "size": size, "measured_unix_s": round(time.time())}
    try:
        _write_cache(path, {**_read_cache(path), key: entry})
    except OSError as e:
        log.warning("could not cache matmul speedups in %s (%s); measuring again next time",
                    path, e)
    return speedups


def _matmul(device: torch.device, precision: str, n: int) -> Callable[[], object]:
    """A closure running one n x n matmul in ``precision`` (inputs made once, off the job's
    random stream)."""
    generator = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(n, n, device=device, generator=generator) for _ in range(2))
    if precision != "fp8":
        dtype = PRECISION_DTYPES[precision]
        a, b = a.to(dtype), b.to(dtype)
        return lambda: torch.mm(a, b)
    a8 = a.to(torch.float8_e4m3fn)
    b8 = b.to(torch.float8_e4m3fn).t().contiguous().t()  # column-major, as _scaled_mm wants
    one = torch.ones((), device=device)
    return lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


def _timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    if device.type != "cuda":
        def wall(fn: Callable[[], object]) -> float:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
        return wall

    def events(fn: Callable[[], object]) -> float:
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    return events


def _precisions(device: torch.device) -> list[str]:
    out = ["fp32", "bf16", "fp16"]
    if (device.type == "cuda" and hasattr(torch, "_scaled_mm")
            and torch.cuda.get_device_capability(device) >= (8, 9)):
        out.append("fp8")
    return out


def _benchmark(device: torch.device) -> tuple[dict[str, float], int]:
    """Speed relative to fp32 per precision, and the matmul size measured at.

    The size grows until an fp32 matmul takes ~1 ms or the slowest dtype ~20 ms, so a dtype
    20-100x slower than fp32 (fp16 on most CPUs) stays bounded. Then up to five rounds take
    one sample per dtype, rotating their order so drift hits each alike; the median counts.
    A sample is the fastest of up to three back-to-back calls (the first pays for anything
    that went cold while other dtypes ran). A CPU runs it on one thread (see dtype_speedups).
    """
    timed = _timer(device)

    def sample(fn: Callable[[], object]) -> float:
        best = spent = timed(fn)
        for _ in range(2):
            if spent >= _SAMPLE_S:
                break
            t = timed(fn)
            best, spent = min(best, t), spent + t
        return best

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    live = _precisions(device)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        with torch.no_grad():
            size = _SIZES[0]
            for size in _SIZES:
                seconds: dict[str, float] = {}
                for precision in list(live):
                    try:
                        seconds[precision] = sample(_matmul(device, precision, size))
                    except (RuntimeError, TypeError) as e:
                        if precision == "fp32":
                            raise
                        log.info("no %s matmul on %s: %s", precision, device, e)
                        live.remove(precision)
                if seconds["fp32"] >= _TARGET_S or max(seconds.values()) >= _SLOWEST_CAP_S:
                    break
            fns = {p: _matmul(device, p, size) for p in live}
            samples: dict[str, list[float]] = {p: [] for p in live}
            start = time.perf_counter()
            for r in range(_ROUNDS):
                if r and time.perf_counter() - start > _BUDGET_S:
                    break
                for precision in live[r % len(live):] + live[:r % len(live)]:
                    samples[precision].append(sample(fns[precision]))
    finally:
        torch.set_num_threads(threads)
    fp32 = statistics.median(samples["fp32"])
    return {p: fp32 / statistics.median(s) for p, s in samples.items()}, size
