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

_ZLIB_LEVEL = 3
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


def _pack_planes(planes: np.ndarray) -> list[bytes]:
    """Per frame (``planes``: frames x words x 8 bytes): its byte-shuffled words without the
    all-zero byte planes, zlib'd after a one-byte mask of the planes kept.

    The shuffle and the dropping are one array operation each over all frames, so a frame
    costs one compress call: with a gather per frame (``planes[f][:, kept]``, numpy's
    element-by-element fancy indexing) a fold's rollup pieces (7 columns of 1 or 2 buckets)
    took 1.46x as long to encode."""
    count, words = planes.shape[0], planes.shape[1]
    masks = planes.any(axis=1)  # frames x 8: the planes that carry anything
    kept_rows = np.ascontiguousarray(planes.transpose(0, 2, 1))[masks].reshape(-1)
    mask_bytes = (masks << np.arange(8, dtype=np.uint8)).sum(axis=1, dtype=np.uint8).tolist()
    ends = (np.cumsum(masks.sum(axis=1)) * words).tolist()
    out, start = [], 0
    for f in range(count):
        out.append(bytes((mask_bytes[f],)) + zlib.compress(kept_rows[start:ends[f]].data,
                                                          _ZLIB_LEVEL))
        start = ends[f]
    return out


def _unpack(blob: bytes | memoryview, n: int) -> np.ndarray:
    kept = [i for i in range(8) if blob[0] >> i & 1]
    planes = np.zeros((n, 8), dtype=np.uint8)
    if kept:
        planes[:, kept] = np.frombuffer(zlib.decompress(blob[1:]), dtype=np.uint8
                                        ).reshape(len(kept), n).T
    return planes.view("<u8").reshape(n)


def _time_words(t: np.ndarray) -> tuple[list[bytes], np.ndarray]:
    """Heads and words of int64 timestamp columns (one per row of ``t``)."""
    deltas = np.diff(t, axis=1)
    bases = _medians(deltas) if deltas.shape[1] else [0] * t.shape[0]
    words = np.zeros(t.shape, dtype=np.uint64)
    words[:, 1:] = _zigzag(deltas - np.array(bases, dtype=np.int64)[:, None])
    return [_TIMES.pack(int(first), base) for first, base in zip(t[:, 0], bases, strict=True)
            ], words


def _medians(x: np.ndarray) -> list[int]:
    """``int(np.median(row))`` of each row of int64 ``x`` (the mean of the two middle values
    as float64 for an even length, as numpy takes it), from one sort: ``np.median`` cost
    more than the rest of a small frame's encoding."""
    ordered = np.sort(x, axis=1)
    m = ordered.shape[1]
    middle = ordered[:, m // 2].astype(np.float64)
    if m % 2 == 0:
        middle = (ordered[:, m // 2 - 1].astype(np.float64) + middle) / 2
    return [int(b) for b in middle.tolist()]


def _whole(v: np.ndarray) -> np.ndarray:
    """Per row of ``v``: every value a whole number below 2**53 in magnitude (so finite) and
    none of them -0.0."""
    return ((np.abs(v) < _INT_LIMIT) & (v == np.rint(v))  # type: ignore[no-any-return]
            & ~(np.signbit(v) & (v == 0))).all(axis=1)


def _value_words(v: np.ndarray) -> tuple[list[bytes], np.ndarray]:
    """Heads (the transform's tag) and words of float64 value columns (one per row of ``v``)."""
    whole = _whole(v)
    words = v.view(np.uint64).copy()
    words[:, 1:] ^= words[:, :-1].copy()
    if whole.any():
        ints = v[whole].astype(np.int64)
        ints[:, 1:] -= ints[:, :-1].copy()
        words[whole] = _zigzag(ints)
    return [_TAG_INT if w else _TAG_XOR for w in whole.tolist()], words


def encode_frame(kinds: str, columns: list[np.ndarray]) -> bytes:
    """Encode equal-length columns in one blob; ``kinds[i]`` is "t" (int64 ns) or "v" (float64).

    One zlib stream for all columns keeps the fixed cost per blob low (a rollup piece of a few
    buckets has seven columns); the columns of a kind are transformed together, as one array.
    """
    return encode_frames(kinds, [columns])[0]


def encode_frames(kinds: str, frames: list[list[np.ndarray]]) -> list[bytes]:
    """:func:`encode_frame` of each of ``frames``, byte for byte, with the transforms of all
    frames of one length done as one array: a fold encodes a small blob for each of thousands
    of series, and the numpy calls per blob cost more than the bytes in it."""
    out: list[bytes] = [b""] * len(frames)
    by_length: dict[int, list[int]] = {}
    for i, columns in enumerate(frames):
        by_length.setdefault(len(columns[0]), []).append(i)
    for n, which in by_length.items():
        for i, blob in zip(which, _encode_same_length(kinds, [frames[i] for i in which], n),
                           strict=True):
            out[i] = blob
    return out


def _encode_same_length(kinds: str, frames: list[list[np.ndarray]], n: int) -> list[bytes]:
    count = len(frames)
    heads: list[list[bytes]] = [[b""] * len(kinds) for _ in range(count)]
    words = np.empty((count, len(kinds), n), dtype=np.uint64)
    for kind, transform, dtype in (("t", _time_words, np.int64), ("v", _value_words,
                                                                   np.float64)):
        rows = [i for i, k in enumerate(kinds) if k == kind]
        if rows:
            stacked = np.array([[np.asarray(columns[i], dtype=dtype) for i in rows]
                                for columns in frames]).reshape(count * len(rows), n)
            kind_heads, kind_words = transform(stacked)
            words[:, rows] = kind_words.reshape(count, len(rows), n)
            for f in range(count):
                for j, i in enumerate(rows):
                    heads[f][i] = kind_heads[f * len(rows) + j]
    planes = words.reshape(count, -1).astype("<u8", copy=False).view(np.uint8).reshape(
        count, -1, 8)
    return [b"".join(head) + packed for head, packed in zip(heads, _pack_planes(planes),
                                                            strict=True)]


def decode_frame(blob: bytes, kinds: str, n: int) -> list[np.ndarray]:
    """Inverse of :func:`encode_frame` for columns of length ``n``."""
    heads, pos = [], 0
    for kind in kinds:
        size = _TIMES.size if kind == "t" else 1
        heads.append(blob[pos:pos + size])
        pos += size
    words = _unpack(memoryview(blob)[pos:], n * len(kinds)).reshape(len(kinds), n)
    out = []
    for kind, head, w in zip(kinds, heads, words, strict=True):
        w = w.copy()
        if kind == "t":
            first, base = _TIMES.unpack(head)
            t = _unzigzag(w)
            t += base
            t[0] = first
            out.append(np.cumsum(t, out=t))
        elif head == _TAG_INT:
            ints = _unzigzag(w)
            out.append(np.cumsum(ints, out=ints).astype(np.float64))
        else:
            out.append(np.bitwise_xor.accumulate(w).view(np.float64))
    return out


def encode_times(times_ns: np.ndarray) -> bytes:
    """Encode sorted or unsorted int64 nanosecond timestamps (length >= 1)."""
    return encode_frame("t", [times_ns])


def decode_times(blob: bytes, n: int) -> np.ndarray:
    """Inverse of :func:`encode_times` for a chunk of ``n`` timestamps."""
    return decode_frame(blob, "t", n)[0]


def encode_values(values: np.ndarray) -> bytes:
    """Encode float64 values exactly, choosing the integer or the XOR transform per chunk."""
    return encode_frame("v", [values])


def decode_values(blob: bytes, n: int) -> np.ndarray:
    """Inverse of :func:`encode_values` for a chunk of ``n`` values."""
    return decode_frame(blob, "v", n)[0]
