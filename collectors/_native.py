"""Plain C helpers, built with the machine's C compiler on first use, cached, loaded by ctypes.

No Python or torch headers: a build takes about a second, and the torch-free sidecar can use
one too. A build lands in ``$SEEDANCE_CACHE_DIR`` (default ``~/.cache/seedance-tuner``) under a
name hashed from the source, compiler and flags, written to a temporary file and renamed, so
processes starting together never load half a library. Every caller keeps a pure Python (or
torch) path that gives the same numbers, which the tests hold each library to, and falls back
to it when there is no compiler (``$CC``, else ``cc`` or ``gcc``), the build fails, or the
caller's switch is set to ``0``. ctypes releases the GIL for each call, so threads calling a
helper run at once.

A machine without a compiler (the sidecar's container image) loads a library built ahead for
it instead: ``python -m collectors._native`` builds the sidecar's own (``SIDECAR_SOURCES``)
into ``$SEEDANCE_CACHE_DIR`` under names taken from the source and flags alone
(``prebuilt_path``), which ``load_native`` loads before it looks for a compiler.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

NATIVE_FLAGS = ("-O3", "-fPIC", "-shared", "-fvisibility=hidden")
JSON_TEMPLATE_SOURCE = Path(__file__).parent / "csrc" / "json_template.c"
SIDECAR_SOURCES = (JSON_TEMPLATE_SOURCE,)
"""The C the torch-free sidecar loads (the KV kernel is the job's, beside torch)."""


def cache_dir() -> Path:
    env = os.environ.get("SEEDANCE_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "seedance-tuner"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return name
    return None


def _build(compiler: str, source: Path, flags: tuple[str, ...]) -> Path:
    """The library for this source, compiler and flags: from the cache, or compiled into it."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             check=True, timeout=30).stdout
    digest = hashlib.sha256(source.read_bytes() + version.encode() + " ".join(flags).encode())
    target = cache_dir() / f"{source.stem}-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{source.stem}-", suffix=".so")
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, "-o", partial, str(source)], capture_output=True,
                       text=True, check=True, timeout=120)
        os.replace(partial, target)
    finally:
        Path(partial).unlink(missing_ok=True)
    return target


def prebuilt_path(source: Path, flags: tuple[str, ...] = NATIVE_FLAGS) -> Path:
    """Where a library built ahead for this source and flags lies: named from them alone, as a
    machine without a compiler cannot name the compiler that built it."""
    digest = hashlib.sha256(source.read_bytes() + " ".join(flags).encode())
    return cache_dir() / f"{source.stem}-prebuilt-{digest.hexdigest()[:16]}.so"


def prebuild(source: Path, flags: tuple[str, ...] = NATIVE_FLAGS) -> Path:
    """Build ``source`` now and place it at ``prebuilt_path`` (written aside, then renamed), for
    a machine with the same C library and no compiler; ``RuntimeError`` without a compiler."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler (set $CC) to build ahead with")
    built, target = _build(compiler, source, flags), prebuilt_path(source, flags)
    fd, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{target.stem}-", suffix=".so")
    os.close(fd)
    try:
        shutil.copyfile(built, partial)
        os.replace(partial, target)
    finally:
        Path(partial).unlink(missing_ok=True)
    return target


def load_native(source: Path, function: str, argtypes: list[Any], *,
                flags: tuple[str, ...] = NATIVE_FLAGS, switch: str, fallback: str,
                log: logging.Logger) -> Callable[..., int] | None:
    """``function`` (returning a C int) of the library built from ``source``, or None when
    ``$switch`` is ``0`` (quietly) or it cannot be built (a warning on ``log`` that ends
    "..., ``fallback``"). Callers cache the answer, so each process tries once."""
    if os.environ.get(switch, "1") == "0":
        return None
    prebuilt = prebuilt_path(source, flags)
    built_ahead = prebuilt.is_file()
    compiler = None if built_ahead else _compiler()
    if compiler is None and not built_ahead:
        log.warning("no C compiler (set $CC) and no library built ahead at %s: %s", prebuilt,
                    fallback)
        return None
    try:
        library = prebuilt if compiler is None else _build(compiler, source, flags)
        fn = getattr(ctypes.CDLL(str(library)), function)
    except (OSError, subprocess.SubprocessError) as e:
        said = (str(getattr(e, "stderr", "") or "").strip().splitlines() or [str(e)])[-1]
        log.warning("building %s failed, %s: %s", source.name, fallback, said)
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = argtypes
    return fn  # type: ignore[no-any-return]


def main() -> None:
    """Build the sidecar's libraries ahead into ``$SEEDANCE_CACHE_DIR`` (a container build)."""
    for source in SIDECAR_SOURCES:
        print(prebuild(source))


if __name__ == "__main__":
    main()
