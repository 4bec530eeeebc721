"""Repeat OTLP/JSON exports handed on as columns over a known shape, as protobuf ones are.

JSON numbers change width from one export to the next, so the byte templates that decode a
repeat protobuf body (`collectors._otlp_templates`) cannot hold, and the walk to Points stays.
What a shape saves is downstream: the series limiter, ``/metrics`` and the store work out a
shape's series once, then take each repeat as two arrays, where Points cost each of them a
lookup per point, most of a JSON request's cost at the sink.

A body's shape is its Points' names and attribute sets, in order. A shape is used from its
second body on (a one-off export is never worth one); the shapes kept are bounded in number
and points, least recently used first out, with the template limits.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from collectors._otlp_decode import DecodedMetrics, Shape
from collectors._otlp_templates import MAX_TEMPLATE_POINTS, MAX_TEMPLATES, MIN_TEMPLATE_POINTS

_ShapeKey = tuple[tuple[str, tuple[tuple[str, str], ...]], ...]
_INT64_END = 2**63


class JsonShapes:
    """Decodes with ``decode`` and gives a repeat shape's Points as columns. Thread-safe."""

    def __init__(self, decode: Callable[[bytes], DecodedMetrics], *,
                 max_shapes: int = MAX_TEMPLATES, max_points: int = MAX_TEMPLATE_POINTS) -> None:
        self._decode = decode
        self._max_shapes = max_shapes
        self._max_points = max_points
        self._lock = threading.Lock()
        self._shapes: OrderedDict[int, tuple[_ShapeKey, Shape | None]] = OrderedDict()
        """By the hash of its key (hashing a body's key is a pass over every attribute, so it
        is done once): the key, and its shape, None until its second body."""
        self._points = 0
        self.hits = 0
        """Bodies handed on as columns."""

    def decode(self, body: bytes) -> DecodedMetrics:
        decoded = self._decode(body)
        points = decoded.points
        if len(points) < MIN_TEMPLATE_POINTS:
            return decoded
        key = tuple((p.name, tuple(p.attributes.items())) for p in points)
        digest = hash(key)
        times = [p.time_ns for p in points]
        with self._lock:
            found = self._shapes.get(digest)
            if found is None or found[0] != key:  # new (or a hash shared by another shape)
                self._keep(digest, key, None)
                return decoded
            self._shapes.move_to_end(digest)
            shape = found[1]
            if shape is None:
                shape = Shape([p.name for p in points], [p.attributes for p in points])
                self._shapes[digest] = (key, shape)
            if max(times) >= _INT64_END:  # past 2262: Points keep the exact int, for the
                return decoded  # store to refuse, as the reference path does
            self.hits += 1
        return DecodedMetrics(metrics=decoded.metrics, shape=shape,
                              times=np.array(times, dtype=np.int64),
                              values=np.array([p.value for p in points], dtype=np.float64))

    def _keep(self, digest: int, key: _ShapeKey, shape: Shape | None) -> None:
        """Remember ``key`` (its shape once built), dropping the least recently used past the
        limits. Under the lock."""
        old = self._shapes.pop(digest, None)
        self._points += len(key) - (0 if old is None else len(old[0]))
        self._shapes[digest] = (key, shape)
        while len(self._shapes) > 1 and (len(self._shapes) > self._max_shapes
                                         or self._points > self._max_points):
            _, (gone, _) = self._shapes.popitem(last=False)
            self._points -= len(gone)
