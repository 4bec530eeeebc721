"""Repeat OTLP exports decoded from a template: one byte pass, no protobuf walk.

An OpenTelemetry SDK exports the same series every interval: between two exports of one
process only the fixed-width numbers change (timestamps, gauge and sum values, histogram counts
and sums), so the bytes are the same everywhere else. A template remembers where those numbers
sit in one export and which Point each becomes; a later body that equals the template's outside
those bytes (checked by comparing the body, with them zeroed, to the template's) is decoded by gathering them
with numpy, and the protobuf walk and attribute building, most of the receiver's work per
point, are skipped.

Correctness does not rest on the wire walk that finds the numbers: before a template is used it
decodes a probe, the body with a distinct value written into every slot, and must give exactly
the Points that ``points_from_request`` gives for that probe; otherwise the shape is left to the
reference path. Shapes with exponential histograms, summaries or exemplars are not templated.
A shape whose templates keep changing before they pay off is not templated again, and builds
have a budget, so a client whose exports never repeat costs a few builds a second at most, not
one per request.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Final, Protocol, cast

import numpy as np

from collectors._otlp_decode import DecodedMetrics, MetricInfo, Shape, points_from_request
from collectors._otlp_wire import WireError, fields, varint
from collectors._points import Point

MAX_TEMPLATES: Final = 256
"""Shapes kept (least recently used go first): a sidecar's exporters, one shape each."""
MAX_TEMPLATE_POINTS: Final = 200_000
"""Points all kept templates may produce together: bounds their memory (about 0.5 KiB each,
plus twice the body's bytes per point for the shape check, about 0.15 KiB in an SDK export)."""
BUILDS_PER_S: Final = 16
"""Template builds a second at most (bursts of as many): a build costs about three reference
decodes, so a client whose exports never repeat costs at most 16 of them a second."""
MIN_TEMPLATE_POINTS: Final = 16
"""Smaller exports decode fast enough; a template would only cost memory."""

_PAYS_AFTER_HITS: Final = 8
_MAX_STRIKES: Final = 3
"""A shape whose template changed this many times in a row, each before it had decoded
``_PAYS_AFTER_HITS`` bodies, is left to the reference path."""
_NO_RECORDED_VALUE: Final = 1
_WORD = np.arange(8, dtype=np.int64)


class _NoTemplate(WireError):
    """This body's shape is not one a template can decode."""


# Slot kinds: how an 8-byte word of the body becomes a value.
_TIME, _DOUBLE, _INT, _COUNT, _BUCKET, _IGNORED = range(6)


@dataclass
class _Slots:
    """The 8-byte words of a body that change between exports, and what each is."""

    offsets: list[int]
    kinds: list[int]

    def add(self, offset: int, kind: int) -> int:
        self.offsets.append(offset)
        self.kinds.append(kind)
        return len(self.offsets) - 1


@dataclass
class _Spec:
    """Which slots each output Point reads: its time word, and its value as one word or as
    the cumulative sum of a run of bucket words."""

    time: list[int]
    value: list[int]  # a word index, or -1 for a cumulative bucket
    bucket_run: list[tuple[int, int]]  # (first word, words summed) of each cumulative point


def _point_words(buf: bytes, start: int, end: int, slots: _Slots, kinds: dict[int, int],
                 exemplars: int, flags: int) -> tuple[dict[int, int], list[tuple[int, int, int,
                                                                           int]]] | None:
    """One data point: the slot of each fixed-width field of ``kinds`` by field number (the
    last one, as a parser keeps it) and the point's other fields; None when its ``flags``
    say it holds no recorded value."""
    words: dict[int, int] = {}
    others = []
    skipped = False
    for number, wire, a, b in fields(buf, start, end):
        if number == exemplars:
            raise _NoTemplate("exemplars")
        if wire == 1 and number in kinds:
            words[number] = slots.add(a, kinds[number])
        elif number == flags and wire == 0:
            skipped = bool(varint(buf, a)[0] & _NO_RECORDED_VALUE)
        else:
            others.append((number, wire, a, b))
    return None if skipped else (words, others)


def _number_point(buf: bytes, start: int, end: int, slots: _Slots, spec: _Spec) -> None:
    found = _point_words(buf, start, end, slots, {2: _IGNORED, 3: _TIME, 4: _DOUBLE, 6: _INT},
                         exemplars=5, flags=8)
    if found is None:
        return
    words = found[0]
    value = max(words.get(4, -1), words.get(6, -1))  # a oneof: the later field wins
    if 3 not in words or value < 0:
        raise _NoTemplate("a data point without time or value")
    spec.time.append(words[3])
    spec.value.append(value)


def _histogram_point(buf: bytes, start: int, end: int, slots: _Slots, spec: _Spec) -> None:
    found = _point_words(buf, start, end, slots, {2: _IGNORED, 3: _TIME, 4: _COUNT, 5: _DOUBLE,
                                                  11: _IGNORED, 12: _IGNORED},
                         exemplars=8, flags=10)
    if found is None:
        return
    words, others = found
    buckets: list[int] = []
    bounds = 0
    for number, wire, a, b in others:
        if number == 6 and wire in (1, 2):
            if (b - a) % 8:
                raise _NoTemplate("bucket counts not fixed64")
            buckets.extend(slots.add(o, _BUCKET) for o in range(a, b, 8))
        elif number == 7 and wire in (1, 2):
            bounds += (b - a) // 8
    if 3 not in words or 4 not in words:
        raise _NoTemplate("a histogram point without time or count")
    time, count = words[3], words[4]
    # as points_from_request: count, sum (when present), cumulative buckets, +Inf = count
    for word in (count, words.get(5, -1)):
        if word >= 0:
            spec.time.append(time)
            spec.value.append(word)
    if buckets:
        for k in range(min(bounds, len(buckets))):
            spec.time.append(time)
            spec.value.append(-1)
            spec.bucket_run.append((buckets[0], k + 1))
        spec.time.append(time)
        spec.value.append(count)


def _messages(buf: bytes, start: int, end: int, number: int) -> list[tuple[int, int]]:
    """(start, end) of each length-delimited field ``number`` of one message."""
    return [(a, b) for n, wire, a, b in fields(buf, start, end) if n == number and wire == 2]


def _walk(body: bytes) -> tuple[_Slots, _Spec]:
    """Where every changing number of ``body`` sits, and the Points they make, in the order
    ``points_from_request`` makes them."""
    slots, spec = _Slots([], []), _Spec([], [], [])
    for resource_metrics in _messages(body, 0, len(body), 1):
        for scope_metrics in _messages(body, *resource_metrics, 2):
            for metric in _messages(body, *scope_metrics, 2):
                data = [(n, wire, a, b) for n, wire, a, b in fields(body, *metric)
                        if n in (5, 7, 9, 10, 11)]
                if len(data) > 1:
                    raise _NoTemplate("a metric with more than one data field")
                for number, wire, a, b in data:
                    if number not in (5, 7, 9) or wire != 2:
                        raise _NoTemplate("exponential histogram or summary")
                    convert = _histogram_point if number == 9 else _number_point
                    for point in _messages(body, a, b, 1):
                        convert(body, *point, slots, spec)
    return slots, spec


class _Template:
    """One shape: where its words are, how Points are made of them, and the shared names,
    attributes and metric metadata of those Points."""

    def __init__(self, body: bytes, slots: _Slots, spec: _Spec, names: list[str],
                 attributes: list[Mapping[str, str]], metrics: dict[str, MetricInfo]) -> None:
        offsets = np.asarray(slots.offsets, dtype=np.int64)
        self.gather = offsets[:, None] + _WORD
        self.keep = np.full(len(body), 0xFF, dtype=np.uint8)
        """0 over the changing words, 0xFF elsewhere: a body ANDed with it is its shape."""
        self.keep[self.gather] = 0
        self.fixed = self._fixed(body)
        kinds = np.asarray(slots.kinds)
        self.times = np.asarray(spec.time, dtype=np.intp)
        value = np.asarray(spec.value, dtype=np.intp)
        direct = value >= 0
        self.direct_at = np.flatnonzero(direct)
        words = value[direct]
        self.doubles = kinds[words] == _DOUBLE
        self.ints = kinds[words] == _INT
        self.direct_words = words
        self.bucket_at = np.flatnonzero(~direct)
        runs = np.asarray(spec.bucket_run, dtype=np.intp).reshape(-1, 2)
        self.bucket_first, self.bucket_len = runs[:, 0], runs[:, 1]
        self.shape = Shape(names, attributes)
        self.metrics = metrics
        self.hits = 0
        self.strikes = 0  # templates of this shape in a row that changed before paying off

    def _fixed(self, body: bytes) -> bytes:
        """``body`` with its changing words zeroed. Compared whole, not hashed: a memcmp is
        a tenth of the cost of a digest, and no collision can pass a wrong shape."""
        return (np.frombuffer(body, dtype=np.uint8) & self.keep).tobytes()

    @property
    def points(self) -> int:
        return len(self.shape.names)

    def decode_matching(self, body: bytes) -> DecodedMetrics | None:
        """``body``'s Points as columns over the shape; None when it is not of this shape."""
        if len(body) != self.keep.size or self._fixed(body) != self.fixed:
            return None
        return self.decode(body)

    def columns(self, body: bytes) -> tuple[np.ndarray, np.ndarray]:
        """The time (uint64 ns) and value of every Point of ``body`` (a body that matches)."""
        words = np.frombuffer(body, dtype=np.uint8)[self.gather].view("<u8").ravel()
        values = np.empty(self.times.shape[0], dtype=np.float64)
        direct = words[self.direct_words]
        values[self.direct_at] = np.where(
            self.doubles, direct.view("<f8"),
            np.where(self.ints, direct.view("<i8").astype(np.float64),
                     direct.astype(np.float64)))
        if self.bucket_at.size:
            # cumulative sums of each run: prefix sums over the bucket words (mod 2**64, as
            # the runs' true totals fit in 64 bits)
            prefix = np.concatenate([[np.uint64(0)], np.cumsum(words)])
            totals = prefix[self.bucket_first + self.bucket_len] - prefix[self.bucket_first]
            values[self.bucket_at] = totals.astype(np.float64)
        return words[self.times], values

    def decode(self, body: bytes) -> DecodedMetrics:
        return template_columns(self.shape, self.metrics, *self.columns(body))


def template_columns(shape: Shape, metrics: dict[str, MetricInfo], times: np.ndarray,
                     values: np.ndarray) -> DecodedMetrics:
    """A template's columns (times as uint64 ns) over its shape; Points when a time is past
    int64 (2262), as the reference path keeps the exact int there, for the store to refuse."""
    if int(times.max()) >= 2**63:
        return DecodedMetrics(points=list(map(Point, shape.names, values.tolist(),
                                              times.tolist(), shape.attributes)),
                              metrics=dict(metrics))
    return DecodedMetrics(metrics=dict(metrics), shape=shape, times=times.view(np.int64),
                          values=values)


def _probe(body: bytes, slots: _Slots) -> bytes:
    """``body`` with a distinct, exactly representable number in every slot."""
    n = len(slots.offsets)
    kinds = np.asarray(slots.kinds)
    words = np.arange(1, n + 1, dtype=np.uint64) * np.uint64(7919)
    doubles = kinds == _DOUBLE
    words[doubles] = (np.arange(n, dtype=np.float64)[doubles] + 0.5).view(np.uint64)
    times = kinds == _TIME
    words[times] += np.uint64(1_700_000_000 * 10**9)
    probe = np.frombuffer(body, dtype=np.uint8).copy()
    probe[np.asarray(slots.offsets, dtype=np.int64)[:, None] + _WORD] = \
        words.astype("<u8").view(np.uint8).reshape(n, 8)
    return probe.tobytes()


def _build(body: bytes, reference: Callable[[bytes], DecodedMetrics]) -> _Template | None:
    try:
        slots, spec = _walk(body)
    except WireError:
        return None
    if len(spec.time) < MIN_TEMPLATE_POINTS:
        return None
    probe = _probe(body, slots)
    try:
        reference_probe = reference(probe)
    except Exception:  # a walk that misread the body: the probe broke it; no template
        return None
    expected = reference_probe.points
    if len(expected) != len(spec.time):
        return None
    template = _Template(body, slots, spec, [p.name for p in expected],
                         [p.attributes for p in expected],
                         reference_probe.metrics)
    times, values = template.columns(probe)
    if (times.tolist() != [p.time_ns for p in expected]
            or values.tolist() != [p.value for p in expected]):
        return None
    return template


class _Budget:
    """A token bucket: ``rate`` a second, holding at most ``rate``."""

    def __init__(self, rate: float, clock: Callable[[], float]) -> None:
        self._rate = rate
        self._clock = clock
        self._tokens = rate
        self._at = clock()

    def take(self) -> bool:
        now = self._clock()
        self._tokens = min(self._rate, self._tokens + (now - self._at) * self._rate)
        self._at = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True


class Template(Protocol):
    """One shape's template, of either encoding."""

    hits: int
    strikes: int

    @property
    def points(self) -> int: ...

    def decode_matching(self, body: bytes) -> DecodedMetrics | None: ...


class _LengthPrefixKeys:
    """Protobuf shapes by the body's length and its bytes up to the first changing number (a
    prefix whose length only a template knows, so each length's prefix lengths are indexed)."""

    def __init__(self) -> None:
        self._prefixes: dict[int, dict[int, int]] = {}  # length -> prefix length -> shapes

    def candidates(self, body: bytes) -> list[Hashable]:
        return [(len(body), body[:prefix]) for prefix in self._prefixes.get(len(body), {})]

    def seen(self, body: bytes) -> Hashable:
        return len(body)

    def key(self, body: bytes, template: Template) -> Hashable:
        assert isinstance(template, _Template)
        return (len(body), body[:int(template.gather[0, 0])])

    def added(self, key: Hashable) -> None:
        length, prefix = cast(tuple[int, bytes], key)
        by_prefix = self._prefixes.setdefault(length, {})
        by_prefix[len(prefix)] = by_prefix.get(len(prefix), 0) + 1

    def removed(self, key: Hashable) -> None:
        length, prefix = cast(tuple[int, bytes], key)
        by_prefix = self._prefixes[length]
        by_prefix[len(prefix)] -= 1
        if not by_prefix[len(prefix)]:
            del by_prefix[len(prefix)]
            if not by_prefix:
                del self._prefixes[length]


class FunctionKeys:
    """Shapes by a key computed from the body alone (None: a body no template is tried for)."""

    def __init__(self, key_of: Callable[[bytes], Hashable | None]) -> None:
        self._key_of = key_of

    def candidates(self, body: bytes) -> list[Hashable]:
        key = self._key_of(body)
        return [] if key is None else [key]

    def seen(self, body: bytes) -> Hashable:
        return self._key_of(body)

    def key(self, body: bytes, template: Template) -> Hashable:
        return self._key_of(body)

    def added(self, key: Hashable) -> None:
        pass

    def removed(self, key: Hashable) -> None:
        pass


class ExportTemplates:
    """Decodes metric exports, from a template when the body repeats a known shape.

    Gives exactly what ``reference`` gives; thread-safe. By default the templates are
    protobuf's (shapes found by the body's length and its bytes up to the first changing
    number, so exporters whose resources differ never share a template); ``build`` and
    ``keys`` give another encoding's.
    """

    def __init__(self, reference: Callable[[bytes], DecodedMetrics], *,
                 build: Callable[[bytes], Template | None] | None = None,
                 keys: _LengthPrefixKeys | FunctionKeys | None = None,
                 max_templates: int = MAX_TEMPLATES,
                 max_points: int = MAX_TEMPLATE_POINTS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._reference = reference
        self._build: Callable[[bytes], Template | None] = (
            build if build is not None else lambda body: _build(body, reference))
        self._keys = keys if keys is not None else _LengthPrefixKeys()
        self._max_templates = max_templates
        self._max_points = max_points
        self._lock = threading.Lock()
        # key -> template, or None for a shape not worth templating
        self._shapes: OrderedDict[Hashable, Template | None] = OrderedDict()
        self._seen: OrderedDict[Hashable, None] = OrderedDict()  # bodies' seen keys
        self._budget = _Budget(BUILDS_PER_S, clock)
        self._points = 0
        self.hits = 0
        """Bodies decoded from a template."""
        self.misses = 0
        """Bodies decoded by the reference path."""
        self.builds = 0
        """Templates built (each costs about three reference decodes)."""

    def decode(self, body: bytes) -> DecodedMetrics:
        found = self._find(body)
        strikes = 0
        if found is not None:
            key, template = found
            if template is None:
                return self._miss(body)
            decoded = template.decode_matching(body)
            if decoded is not None:
                with self._lock:
                    self.hits += 1
                    template.hits += 1
                return decoded
            # The shape changed under its key (a new config version in an attribute): build
            # again, unless its templates keep changing before they pay for themselves.
            strikes = template.strikes + 1 if template.hits < _PAYS_AFTER_HITS else 0
            if strikes >= _MAX_STRIKES:
                with self._lock:
                    self._store(key, None)
                return self._miss(body)
        decoded = self._miss(body)
        self._learn(body, strikes)
        return decoded

    def _miss(self, body: bytes) -> DecodedMetrics:
        with self._lock:
            self.misses += 1
        return self._reference(body)

    def _find(self, body: bytes) -> tuple[Hashable, Template | None] | None:
        with self._lock:
            for key in self._keys.candidates(body):
                if key in self._shapes:
                    self._shapes.move_to_end(key)
                    return key, self._shapes[key]
        return None

    def _learn(self, body: bytes, strikes: int) -> None:
        """Build a template for a body whose seen key (protobuf: its length) came before (a
        one-off export is never worth the build; a protobuf body's first bytes cannot tell
        shapes apart, as a small export's first timestamp sits in them), within the build
        budget."""
        seen = self._keys.seen(body)
        if seen is None:
            return
        with self._lock:
            first = seen not in self._seen
            self._seen[seen] = None
            self._seen.move_to_end(seen)
            while len(self._seen) > self._max_templates:
                self._seen.popitem(last=False)
            if first or not self._budget.take():
                return
            self.builds += 1
        template = self._build(body)
        if template is None:
            return  # not remembered: a protobuf shape's key needs a template, and a JSON build
            # can fail for one export's values alone (a "NaN"); the budget bounds retries
        template.strikes = strikes
        key = self._keys.key(body, template)
        with self._lock:
            self._store(key, template)

    def _store(self, key: Hashable, template: Template | None) -> None:
        old = self._shapes.pop(key, None)
        if old is not None:
            self._points -= old.points
        else:
            self._keys.added(key)
        self._shapes[key] = template
        self._points += 0 if template is None else template.points
        while len(self._shapes) > 1 and (len(self._shapes) > self._max_templates
                                         or self._points > self._max_points):
            gone_key, gone = self._shapes.popitem(last=False)
            self._points -= 0 if gone is None else gone.points
            self._keys.removed(gone_key)


def protobuf_templates(decode: Callable[[bytes], object]) -> ExportTemplates:
    """Templates over the reference path ``points_from_request(decode(body))``."""
    return ExportTemplates(lambda body: points_from_request(decode(body)))  # type: ignore[arg-type]
