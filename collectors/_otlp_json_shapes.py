"""OTLP/JSON exports no template takes, handed on as columns over a known shape.

A repeat export is decoded from a text template (`collectors._otlp_json_templates`); what no
template takes (the first bodies of a shape, a shape the template's probe refuses) is walked
into columns (`collectors._otlp_json.JsonColumns`). What a shape saves then is downstream: the
series limiter, ``/metrics`` and the store work out a shape's series once, then take each
repeat as two arrays, where Points cost each of them a lookup per point.

A body's shape is its Points' names and attribute sets, in order. A shape is used from its
second body on (a one-off export is never worth one); the shapes kept are bounded in number
and points, least recently used first out, with the template limits.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from collectors._otlp_decode import DecodedMetrics, Shape
from collectors._otlp_json import JsonColumns, json_columns
from collectors._otlp_templates import MAX_TEMPLATE_POINTS, MAX_TEMPLATES, MIN_TEMPLATE_POINTS

_ShapeKey = tuple[tuple[str, tuple[tuple[str, str], ...]], ...]


class JsonShapes:
    """Decodes with ``decode`` and hands a repeat shape's columns on over it. Thread-safe."""

    def __init__(self, decode: Callable[[bytes], JsonColumns | DecodedMetrics] = json_columns,
                 *, max_shapes: int = MAX_TEMPLATES, max_points: int = MAX_TEMPLATE_POINTS
                 ) -> None:
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
        columns = self._decode(body)
        if isinstance(columns, DecodedMetrics):  # a body the fast path does not read
            return columns
        names, attributes = columns.names, columns.attributes
        if len(names) < MIN_TEMPLATE_POINTS:
            return columns.decoded()
        key = tuple(zip(names, [tuple(a.items()) for a in attributes], strict=True))
        digest = hash(key)
        with self._lock:
            found = self._shapes.get(digest)
            if found is None or found[0] != key:  # new (or a hash shared by another shape)
                self._keep(digest, key, None)
                return columns.decoded()
            self._shapes.move_to_end(digest)
            shape = found[1]
            if shape is None:
                shape = Shape(names, attributes)  # type: ignore[arg-type]
                self._shapes[digest] = (key, shape)
            decoded = columns.decoded(shape)
            self.hits += decoded.shape is not None
        return decoded

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
