"""Chunk encoding for the time-series store: vectorised numpy transforms plus zlib.

Why this shape: telemetry is regular in time and smooth or stepwise in value, so after a
cheap reversible transform almost every byte is zero or repeats, and a general-purpose
compressor removes it. The transforms (in the spirit of Gorilla / Prometheus TSDB chunks, but
vectorised instead of bit-by-bit):

- timestamps: first value, then each delta minus the chunk's median delta (0 for a perfect
  grid, a few hundred microseconds for a jittery sampler), zigzag-encoded;
- values that are all whole numbers below 2**53 (utilisation, temperatures, clocks, counters):
  zigzag delta of the int64 values;
- any other float64: XOR with the previous value's bits (equal leading bits cancel, and the
  29 trailing zero bits of a float32-derived value stay zero).

The resulting uint64 words are byte-shuffled (all first bytes, then all second bytes, ...);
byte planes that are all zero (the high bytes of small deltas) are left out, flagged in a
one-byte mask, and the rest is zlib-compressed, so decoding inflates only the bytes that carry
information. Every transform is exact: values
round-trip bit for bit, NaN payloads and -0.0 included.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np

_ZLIB_LEVEL = 6
_INT_LIMIT = 2.0**53

_TIMES = struct.Struct("<qq")  # first timestamp, median delta
_TAG_INT = b"i"
_TAG_XOR = b"x"


def _zigzag(x: np.ndarray) -> np.ndarray:
    return ((x << 1) ^ (x >> 63)).view(np.uint64)


def _unzigzag(u: np.ndarray) -> np.ndarray:
    """Inverse of :func:`_zigzag`, in place (``u`` is consumed)."""
    sign = (u & np.uint64(1)).view(np.int64)
    np.negative(sign, out=sign)
    np.right_shift(u, np.uint64(1), out=u)
    out = u.view(np.int64)
    np.bitwise_xor(out, sign, out=out)
    return out


def _pack(words: np.ndarray) -> bytes:
    """Byte-shuffle uint64 words, drop the all-zero byte planes, zlib the rest."""
    planes = words.astype("<u8", copy=False).view(np.uint8).reshape(-1, 8).T
    kept = [i for i in range(8) if planes[i].any()]
    mask = sum(1 << i for i in kept)
    return bytes((mask,)) + zlib.compress(np.ascontiguousarray(planes[kept]).tobytes(),
                                          _ZLIB_LEVEL)


def _unpack(blob: bytes, n: int) -> np.ndarray:
    kept = [i for i in range(8) if blob[0] >> i & 1]
    planes = np.zeros((n, 8), dtype=np.uint8)
    if kept:
        planes[:, kept] = np.frombuffer(zlib.decompress(blob[1:]), dtype=np.uint8
                                        ).reshape(len(kept), n).T
    return planes.view("<u8").reshape(n).astype(np.uint64, copy=False)


def encode_times(times_ns: np.ndarray) -> bytes:
    """Encode sorted or unsorted int64 nanosecond timestamps (length >= 1)."""
    t = np.asarray(times_ns, dtype=np.int64)
    deltas = np.diff(t)
    base = int(np.median(deltas)) if deltas.size else 0
    return _TIMES.pack(int(t[0]), base) + _pack(_zigzag(deltas - base))


def decode_times(blob: bytes, n: int) -> np.ndarray:
    """Inverse of :func:`encode_times` for a chunk of ``n`` timestamps."""
    first, base = _TIMES.unpack_from(blob)
    out = np.empty(n, dtype=np.int64)
    out[0] = first
    np.add(_unzigzag(_unpack(blob[_TIMES.size:], n - 1)), base, out=out[1:])
    return np.cumsum(out, out=out)


def _whole(v: np.ndarray) -> bool:
    finite = np.isfinite(v)
    return bool(finite.all() and (np.abs(v) < _INT_LIMIT).all() and (v == np.rint(v)).all()
                and not np.signbit(v[v == 0]).any())


def encode_values(values: np.ndarray) -> bytes:
    """Encode float64 values exactly, choosing the integer or the XOR transform per chunk."""
    v = np.asarray(values, dtype=np.float64)
    if _whole(v):
        ints = v.astype(np.int64)
        return _TAG_INT + _pack(_zigzag(np.diff(ints, prepend=np.int64(0))))
    bits = v.view(np.uint64)
    return _TAG_XOR + _pack(bits ^ np.concatenate(([np.uint64(0)], bits[:-1])))


def decode_values(blob: bytes, n: int) -> np.ndarray:
    """Inverse of :func:`encode_values` for a chunk of ``n`` values."""
    words = _unpack(blob[1:], n)
    if blob[:1] == _TAG_INT:
        ints = _unzigzag(words)
        return np.cumsum(ints, out=ints).astype(np.float64)
    return np.bitwise_xor.accumulate(words).view(np.float64)


def encode_columns(columns: list[bytes]) -> bytes:
    """Join several encoded columns into one blob (length-prefixed)."""
    head = struct.pack(f"<{len(columns)}I", *(len(c) for c in columns))
    return head + b"".join(columns)


def decode_columns(blob: bytes, count: int) -> list[bytes]:
    """Split a blob written by :func:`encode_columns` with ``count`` columns."""
    sizes = struct.unpack_from(f"<{count}I", blob)
    out, pos = [], 4 * count
    for size in sizes:
        out.append(blob[pos:pos + size])
        pos += size
    return out
