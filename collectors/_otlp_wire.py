"""The protobuf wire format, read by hand where parsing the whole message would cost too much:
the templates' byte walk, and a look at a request's first resource before it is decoded."""

from __future__ import annotations

from collections.abc import Iterator


class WireError(Exception):
    """The bytes are not the protobuf message they were read as."""


def varint(buf: bytes, i: int) -> tuple[int, int]:
    """The varint at ``i`` and the offset after it."""
    result = shift = 0
    while True:
        if i >= len(buf) or shift > 63:
            raise WireError("truncated varint")
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, i
        shift += 7


def iter_fields(buf: bytes, start: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """(field number, wire type, payload start, payload end) of one message's fields, read
    only as far as the caller goes."""
    i = start
    while i < end:
        tag, i = varint(buf, i)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            _, j = varint(buf, i)
        elif wire == 1:
            j = i + 8
        elif wire == 2:
            size, i = varint(buf, i)
            j = i + size
        elif wire == 5:
            j = i + 4
        else:
            raise WireError(f"wire type {wire}")
        if j > end:
            raise WireError("field past its message")
        yield number, wire, i, j
        i = j


def fields(buf: bytes, start: int, end: int) -> list[tuple[int, int, int, int]]:
    """Every field of one message, as :func:`iter_fields` reads them."""
    return list(iter_fields(buf, start, end))


def _first(buf: bytes, start: int, end: int, number: int) -> tuple[int, int] | None:
    """(start, end) of the first length-delimited field ``number``, reading no further."""
    return next(((a, b) for n, wire, a, b in iter_fields(buf, start, end)
                 if n == number and wire == 2), None)


def first_resource_strings(body: bytes) -> dict[str, str] | None:
    """The string attributes of an ``ExportMetricsServiceRequest``'s first resource, read
    without decoding the request (a later duplicate key wins, as in a parser); None when the
    body has no resource or is not such a request. Attributes of other types are left out."""
    try:
        found = _first(body, 0, len(body), 1)  # resource_metrics
        resource = None if found is None else _first(body, *found, 1)  # .resource
        if resource is None:
            return None
        out: dict[str, str] = {}
        for number, wire, a, b in fields(body, *resource):
            if number != 1 or wire != 2:  # attributes
                continue
            key, value = "", None  # proto3: an absent key is ""
            for n, w, c, d in fields(body, a, b):
                if n == 1 and w == 2:
                    key = body[c:d].decode()
                elif n == 2 and w == 2:
                    last = fields(body, c, d)  # AnyValue: a oneof, its last field wins
                    value = (body[last[-1][2]:last[-1][3]].decode()
                             if last and last[-1][:2] == (1, 2) else None)
            if value is None:
                out.pop(key, None)
            else:
                out[key] = value
        return out
    except (WireError, UnicodeDecodeError):
        return None
