"""Repeat OTLP/JSON exports decoded from a text template: no JSON parse, no walk.

Between two exports of one process only numbers change (timestamps, gauge and sum values,
histogram counts and sums), as in protobuf (`collectors._otlp_templates`); in JSON they also
change width, so a template holds no byte offsets. It holds the body's *number runs* (maximal
runs of number characters, in keys and strings too) and which of them are slots (the values of
the numeric fields), and the body's text outside the slots. A later body is of the template's
shape when it has as many runs and the same text outside its slots, the runs found with numpy
in a few passes over the bytes; its slot texts are then parsed by numpy, all at once.

Correctness does not rest on the regular expression that picks the slots: a template is used
only if it decodes a probe (the body with a distinct number written into every slot) and the
body itself exactly as the fast path does (`collectors._otlp_json.points_from_json`). Slot
texts are held to JSON's number grammar, so a malformed number still goes to the reference path
to be refused. A value that is not a plain number (``"NaN"``, ``"Infinity"``) or is out of
range sends the body there too.

The match and the slots' reading run in C (``collectors/csrc/json_template.c``, one pass over
the body, outside the GIL) where a compiler built it (`collectors._native`); the numpy path
below is its reference, which the tests hold it to bit for bit, and the fallback.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import re
from collections.abc import Callable
from typing import Final

import numpy as np

from collectors._native import JSON_TEMPLATE_SOURCE, load_native
from collectors._otlp_decode import DecodedMetrics, MetricInfo, OtlpDecodeError, Shape
from collectors._otlp_templates import (
    MIN_TEMPLATE_POINTS,
    ExportTemplates,
    FunctionKeys,
    template_columns,
)
from collectors._points import Point

_SLOT: Final = re.compile(
    rb'("(?:startTimeUnixNano|timeUnixNano|count|asInt)":\s*"?'
    rb'|"(?:asDouble|sum|min|max)":\s*'
    rb'|"bucketCounts":\s*\[\s*"'
    rb'|"\s*,\s*")'
    rb'(-?\d[\d.eE+-]*)')
"""A slot: what comes before a numeric field's value as OTLP/JSON writes it (the key, the space
some encoders put after a colon, the quote around a 64-bit integer; or the opening of a quoted
bucket count), group 1, and the value's text, group 2. What this picks is checked by the probe,
never trusted."""
_KEY_KIND: Final = {b"startTimeUnixNano": "time", b"timeUnixNano": "time", b"count": "uint",
                    b"asInt": "int", b"asDouble": "double", b"sum": "double",
                    b"min": "double", b"max": "double"}
_KEY: Final = re.compile(rb'"(\w+)":')
_UNTEMPLATED: Final = (b'"exponentialHistogram"', b'"summary"', b'"exemplars"')
"""What the fast path leaves to the reference path, so no template can match it."""
_MAX_WIDTH: Final = 32
"""A slot text longer than this (no JSON number of a 64-bit value needs it) is not templated."""
_BUCKET_RUN: Final = 2**20
_T0: Final = 1_700_000_000 * 10**9
_NATIVE_KIND: Final = {"time": 0, "uint": 0, "bucket": 0, "int": 1, "double": 2}
"""How ``json_template.c`` reads a slot of each kind."""

log = logging.getLogger(__name__)

_Match = Callable[..., int]


@functools.cache
def native_match() -> _Match | None:
    """``seedance_json_template_match`` of ``collectors/csrc/json_template.c``, or None (the
    numpy path) when it is turned off (``SEEDANCE_JSON_NATIVE=0``), or cannot be built and was
    not built ahead (``python -m collectors._native``)."""
    return load_native(JSON_TEMPLATE_SOURCE, "seedance_json_template_match",
                       [ctypes.c_char_p, ctypes.c_int64, ctypes.c_char_p, ctypes.c_void_p,
                        ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p],
                       switch="SEEDANCE_JSON_NATIVE", log=log,
                       fallback="OTLP/JSON templates are read by the slower numpy path")


def _number_chars(b: np.ndarray) -> np.ndarray:
    """Where the bytes are part of a number: digits, '.', '-', and an exponent's 'e', 'E' and
    '+' (after a digit, and after an 'e' or 'E')."""
    digit = (b - np.uint8(48)) < 10
    out = digit | (b == 46) | (b == 45)
    exponent = (b[1:] == 101) | (b[1:] == 69)
    out[1:] |= exponent & digit[:-1]
    out[1:] |= (b[1:] == 43) & ((b[:-1] == 101) | (b[:-1] == 69))
    return out


def _runs(b: np.ndarray) -> np.ndarray | None:
    """(start, end) of every number run, as a flat array start0, end0, start1, ...; None for an
    empty body or one that starts or ends in one (no JSON object does)."""
    if not b.size:
        return None
    chars = _number_chars(b)
    if chars[0] or chars[-1]:
        return None
    return np.flatnonzero(chars[1:] != chars[:-1]) + 1


class _Kinds:
    """Rows of the slot table by how a slot's text is read."""

    def __init__(self, kinds: list[str]) -> None:
        array = np.asarray(kinds)
        self.uint = np.flatnonzero((array == "time") | (array == "uint") | (array == "bucket"))
        self.int = np.flatnonzero(array == "int")
        self.double = np.flatnonzero(array == "double")


def _outside(b: np.ndarray, starts: np.ndarray, ends: np.ndarray,
             alternating: np.ndarray) -> bytes:
    """The bytes of ``b`` outside the spans ``starts[i]:ends[i]``."""
    bounds = np.empty(2 * starts.size + 2, dtype=np.intp)
    bounds[0], bounds[-1] = 0, b.size
    bounds[1:-1:2], bounds[2:-1:2] = starts, ends
    return b[np.repeat(alternating, np.diff(bounds))].tobytes()


class _JsonTemplate:
    """One shape: its fixed text, which runs are its slots, and how Points are made of them."""

    def __init__(self, body: bytes, runs: np.ndarray, slot_runs: list[int], kinds: list[str],
                 spec: tuple[list[int], list[int], list[tuple[int, int]]], shape: Shape,
                 metrics: dict[str, MetricInfo]) -> None:
        self.starts_at = 2 * np.asarray(slot_runs, dtype=np.intp)
        self.ends_at = self.starts_at + 1
        self.edges = runs.size
        self.kinds = _Kinds(kinds)
        self.slot_count = len(kinds)
        self.alternating = np.zeros(2 * self.slot_count + 1, dtype=bool)
        self.alternating[0::2] = True
        starts, ends = runs[self.starts_at], runs[self.ends_at]
        self.fixed = _outside(np.frombuffer(body, np.uint8), starts, ends, self.alternating)
        self.segments = np.diff(np.concatenate([[0], np.column_stack([starts, ends]).ravel(),
                                                [len(body)]]))[0::2].astype(np.int64)
        """The lengths of the fixed text's pieces, before each slot and after the last."""
        self.native_kinds = np.array([_NATIVE_KIND[k] for k in kinds], dtype=np.uint8)
        time_slot, value_slot, bucket_run = spec
        self.time_slot = np.asarray(time_slot, dtype=np.intp)
        value = np.asarray(value_slot, dtype=np.intp)
        self.direct_at = np.flatnonzero(value >= 0)
        self.direct_slot = value[self.direct_at]
        self.bucket_at = np.flatnonzero(value < 0)
        bucket = np.asarray(bucket_run, dtype=np.intp).reshape(-1, 2)
        self.bucket_first, self.bucket_len = bucket[:, 0], bucket[:, 1]
        self.shape = shape
        self.metrics = metrics
        self.hits = 0
        self.strikes = 0

    @property
    def points(self) -> int:
        return len(self.shape.names)

    def decode_matching(self, body: bytes) -> DecodedMetrics | None:
        """``body``'s Points as columns over the shape; None when it is not of this shape, or a
        slot holds what the fast path would not read as this does."""
        match = native_match()
        slots = self._read(body) if match is None else self._read_native(match, body)
        if slots is None:
            return None
        return template_columns(self.shape, self.metrics, *self._points(*slots))

    def _read_native(self, match: _Match, body: bytes) -> tuple[np.ndarray, np.ndarray] | None:
        """As :meth:`_read`, in C."""
        words = np.empty(self.slot_count, dtype=np.uint64)
        values = np.empty(self.slot_count, dtype=np.float64)
        if not match(body, len(body), self.fixed, self.segments.ctypes.data, self.slot_count,
                     self.native_kinds.ctypes.data, words.ctypes.data, values.ctypes.data):
            return None
        return words, values

    def _read(self, body: bytes) -> tuple[np.ndarray, np.ndarray] | None:
        """Each slot's word (the unsigned slots' values, 0 elsewhere) and value; None when
        ``body`` is not of this shape, or holds a number JSON does not allow."""
        b = np.frombuffer(body, np.uint8)
        runs = _runs(b)
        if runs is None or runs.size != self.edges:
            return None
        starts, ends = runs[self.starts_at], runs[self.ends_at]
        if (b.size - int((ends - starts).sum()) != len(self.fixed)
                or _outside(b, starts, ends, self.alternating) != self.fixed):
            return None
        kinds = self.kinds
        words = np.zeros(self.slot_count, dtype=np.uint64)
        unsigned = _unsigned(b, starts[kinds.uint], ends[kinds.uint])
        if unsigned is None:
            return None
        words[kinds.uint] = unsigned
        slot_values = words.astype(np.float64)
        for rows, signed in ((kinds.int, True), (kinds.double, False)):
            if rows.size:
                found = _numbers(b, starts[rows], ends[rows], signed)
                if found is None:
                    return None
                slot_values[rows] = found
        return words, slot_values

    def _points(self, words: np.ndarray, slot_values: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
        """Each Point's time (uint64 ns) and value, from the slots."""
        values = np.empty(self.time_slot.size, dtype=np.float64)
        values[self.direct_at] = slot_values[self.direct_slot]
        if self.bucket_at.size:
            # cumulative sums of each run (mod 2**64, as the runs' true totals fit in 64 bits)
            prefix = np.concatenate([[np.uint64(0)], np.cumsum(words)])
            totals = prefix[self.bucket_first + self.bucket_len] - prefix[self.bucket_first]
            values[self.bucket_at] = totals.astype(np.float64)
        return words[self.time_slot], values


_UINT_DIGITS: Final = 19
"""Digits an unsigned slot may have here (every uint64 below 10**19); a longer one, past
2286 as a timestamp, goes to the reference path."""
_POWERS: Final = 10 ** np.arange(_UINT_DIGITS - 1, -1, -1, dtype=np.uint64)


def _unsigned(b: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray | None:
    """The unsigned integers at ``starts[i]:ends[i]`` (digits only), in one pass of integer
    arithmetic over their right-aligned digits; None if any is not that."""
    if not starts.size:
        return np.zeros(0, dtype=np.uint64)
    widths = ends - starts
    width = int(widths.max())
    if width > _UINT_DIGITS:
        return None
    columns = np.arange(width)
    digits = b.take(ends[:, None] - width + columns, mode="clip") - np.uint8(48)
    digits[columns < (width - widths)[:, None]] = 0
    if (digits > 9).any():
        return None
    return (digits * _POWERS[_UINT_DIGITS - width:]).sum(axis=1, dtype=np.uint64)


def _numbers(b: np.ndarray, starts: np.ndarray, ends: np.ndarray, signed: bool
             ) -> np.ndarray | None:
    """The numbers at ``starts[i]:ends[i]``: int64 ``signed`` integers, or JSON doubles
    (parsed by numpy, which is laxer than JSON, so held to its grammar first); None if any is
    not one."""
    widths = ends - starts
    width = max(int(widths.max()), 3)
    if width > _MAX_WIDTH:
        return None
    columns = np.arange(width)
    chars = b.take(starts[:, None] + columns, mode="clip")
    chars[columns >= widths[:, None]] = 0
    texts = chars.view(f"S{width}").ravel()
    try:
        if signed:
            return texts.astype(np.int64).astype(np.float64)
        if not _json_doubles(chars):
            return None
        doubles = texts.astype(np.float64)
    except (ValueError, OverflowError):
        return None
    if np.isinf(doubles).any() or (texts == b"-0").any():
        return None  # out of range, or an integer -0 (the fast path reads it as 0.0)
    return doubles


def _json_doubles(chars: np.ndarray) -> bool:
    """Whether every row (a null-padded number text) follows JSON's grammar where numpy's
    parser is laxer: a digit first (after a '-'), no leading zero, a digit after each '.'."""
    digit = (chars - np.uint8(48)) < 10
    negative = chars[:, 0] == 45
    first = np.where(negative, chars[:, 1] if chars.shape[1] > 1 else 0, chars[:, 0])
    second = np.where(negative, chars[:, 2] if chars.shape[1] > 2 else 0,
                      chars[:, 1] if chars.shape[1] > 1 else 0)
    if not ((first - np.uint8(48)) < 10).all():
        return False
    if ((first == 48) & ((second - np.uint8(48)) < 10)).any():
        return False
    dots = chars[:, :-1] == 46
    return not (dots & ~digit[:, 1:]).any() and not (chars[:, -1] == 46).any()


def _slots(body: bytes) -> tuple[list[tuple[int, int]], list[str], list[int]]:
    """Each slot's (start, end), its kind, and the index of the bucket array it is in (-1
    outside one)."""
    spans, kinds, arrays = [], [], []
    array = -1
    for match in _SLOT.finditer(body):
        key = _KEY.match(match.group(1))
        if key is not None and key.group(1) in _KEY_KIND:
            kinds.append(_KEY_KIND[key.group(1)])
            arrays.append(-1)
        else:  # a bucket count: the first of an array, or one after another
            if key is not None or not kinds or kinds[-1] != "bucket":
                array += 1
            kinds.append("bucket")
            arrays.append(array)
        spans.append(match.span(2))
    return spans, kinds, arrays


def _probe(body: bytes, spans: list[tuple[int, int]], kinds: list[str],
           arrays: list[int]) -> bytes:
    """``body`` with a distinct number in every slot: time ``_T0 + i``, double ``i + 0.5``,
    integer ``i + 1``; a bucket array's first count ``(array + 1) * 2**20``, its others 1, so
    each cumulative sum tells its array and length."""
    out, at = [], 0
    for i, ((start, end), kind, array) in enumerate(zip(spans, kinds, arrays, strict=True)):
        if kind == "time":
            text = str(_T0 + i)
        elif kind == "double":
            text = f"{i}.5"
        elif kind == "bucket":
            text = str((array + 1) * _BUCKET_RUN if i == 0 or arrays[i - 1] != array else 1)
        else:
            text = str(i + 1)
        out += [body[at:start], text.encode()]
        at = end
    out.append(body[at:])
    return b"".join(out)


def build_json_template(body: bytes, reference: Callable[[bytes], DecodedMetrics]
                        ) -> _JsonTemplate | None:
    """A template for ``body``'s shape, or None when it has none (or it cannot be checked)."""
    if any(kind in body for kind in _UNTEMPLATED):
        return None  # known before the decodes a build costs
    b = np.frombuffer(body, np.uint8)
    runs = _runs(b)
    spans, kinds, arrays = _slots(body)
    if runs is None or not spans:
        return None
    run_of = {int(start): i for i, start in enumerate(runs[0::2])}
    ends = runs[1::2]
    slot_runs = [run_of.get(start, -1) for start, _ in spans]
    if any(r < 0 or int(ends[r]) != end for r, (_, end) in zip(slot_runs, spans, strict=True)):
        return None
    decoded = reference(body)
    expected = decoded.points
    if len(expected) < MIN_TEMPLATE_POINTS or len(kinds) >= _BUCKET_RUN:
        return None
    probe_body = _probe(body, spans, kinds, arrays)
    try:
        probe = reference(probe_body).points
    except OtlpDecodeError:  # a slot misread: the probe broke the body; no template
        return None
    if len(probe) != len(expected):
        return None
    spec = _spec(probe, kinds, arrays)
    if spec is None:
        return None
    template = _JsonTemplate(body, runs, slot_runs, kinds, spec,
                             Shape([p.name for p in expected], [p.attributes for p in expected]),
                             decoded.metrics)
    for text, points in ((body, expected), (probe_body, probe)):
        check = template.decode_matching(text)
        if check is None or check.points != points:
            return None
    return template


def _spec(probe: list[Point], kinds: list[str], arrays: list[int]
          ) -> tuple[list[int], list[int], list[tuple[int, int]]] | None:
    """Which slot holds each Point's time, and its value: a slot, or -1 for a cumulative bucket
    with its (first slot, slots summed); read off the probe's Points (see :func:`_probe`)."""
    first_of_array = {a: i for i, a in reversed(list(enumerate(arrays))) if a >= 0}
    time_slot, value_slot, bucket_run = [], [], []
    for point in probe:
        slot, value = point.time_ns - _T0, point.value
        if not 0 <= slot < len(kinds) or kinds[slot] != "time":
            return None
        time_slot.append(slot)
        if not math.isfinite(value):
            return None
        if value >= _BUCKET_RUN and value == int(value):
            array, more = divmod(int(value), _BUCKET_RUN)
            if array - 1 not in first_of_array:
                return None
            value_slot.append(-1)
            bucket_run.append((first_of_array[array - 1], more + 1))
        elif value == int(value) and 0 < value <= len(kinds):
            value_slot.append(int(value) - 1)
        elif value - 0.5 == int(value - 0.5) and 0 <= value - 0.5 < len(kinds):
            value_slot.append(int(value - 0.5))
        else:
            return None
    return time_slot, value_slot, bucket_run


def json_key(body: bytes) -> bytes | None:
    """What tells exporters' shapes apart before a template is tried: the body up to its first
    timestamp (its resource, so its exporter, and its first metric); None without one."""
    at = body.find(b'UnixNano"')
    return None if at < 0 else body[:at]


def json_templates(reference: Callable[[bytes], DecodedMetrics],
                   fast_path: Callable[[bytes], DecodedMetrics]) -> ExportTemplates:
    """Templates for OTLP/JSON: a miss goes to ``reference``; a build checks against
    ``fast_path`` (Points, as the tests hold both to)."""
    return ExportTemplates(reference, build=lambda body: build_json_template(body, fast_path),
                           keys=FunctionKeys(json_key))
