"""OTLP/HTTP receiver (``POST /v1/metrics``, ``POST /v1/traces``) and an upstream forwarder.

Follows the OTLP/HTTP spec (opentelemetry.io/docs/specs/otlp/#otlphttp): binary protobuf or JSON
bodies, optional gzip, the response in the request's encoding, a ``google.rpc.Status`` body on
every 4xx/5xx. Bad input is answered, never fatal: bodies are capped before and after gzip so a
gzip bomb costs at most ``max_body_bytes`` of memory, and a failing sink is answered 503, which
the spec lists as retryable (429, 502, 503, 504), so exporters send the batch again.
"""

from __future__ import annotations

import asyncio
import email.utils
import hmac
import logging
import queue
import threading
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Final, Generic, TypeVar

import httpx
from fastapi import APIRouter, Request, Response
from google.protobuf import json_format
from google.protobuf.message import Message
from google.rpc.status_pb2 import Status
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from starlette.requests import ClientDisconnect

from collectors._errors import ConfigError, SeedanceError
from collectors._otlp_decode import (
    DecodedMetrics,
    OtlpDecodeError,
    decode_json,
    decode_protobuf,
)
from collectors._otlp_json import points_from_json
from collectors._otlp_json_shapes import JsonShapes
from collectors._otlp_json_templates import json_templates
from collectors._otlp_templates import protobuf_templates
from collectors._otlp_traces import (
    SpanRecord,
    decode_traces_json,
    decode_traces_protobuf,
    spans_from_request,
)
from collectors._otlp_wire import first_resource_strings
from collectors._priority import background_pool

logger = logging.getLogger(__name__)

PROTOBUF: Final = "application/x-protobuf"
JSON: Final = "application/json"
_DECODERS = {PROTOBUF: decode_protobuf, JSON: decode_json}
_FORWARDED_HEADERS = ("content-type", "content-encoding")
_GZIP_WBITS = 16 + zlib.MAX_WBITS

INGEST_WORKERS: Final = 4
"""Worker threads that decode and sink requests at once. Decoding holds the GIL, so more
threads add no throughput, only hand-offs: at 64 exporters, a thread per request (anyio's 40)
left the sidecar a third idle and halved its points/s, where 4 kept it busy
(``bench/otlp_ingest.py``). A pool of its own, apart from anyio's, leaves the API's threads free
and runs below them (`collectors._priority`)."""


class BodyTooLarge(SeedanceError):
    """A request body, before or after gzip, is larger than the receiver's limit."""


@dataclass
class ReceiverStats:
    """What the receiver accepted and rejected since it started; plain ints, safe to read.

    A request is accepted when it was answered 200; points are counted only once decoded, so a
    request rejected before decoding adds to ``requests_rejected`` alone.
    """

    requests_accepted: int = 0
    requests_rejected: int = 0
    points_accepted: int = 0
    points_rejected: int = 0
    spans_accepted: int = 0
    spans_rejected: int = 0
    bytes_received: int = 0
    sink_errors: int = 0
    requests_templated: int = 0
    """Accepted metric exports that repeat a known shape, handed on as columns (protobuf ones
    decoded from a byte template)."""
    requests_throttled: int = 0
    """Requests the sink turned away with 429 (a sender over its share): counted, not logged
    as errors, as at load they come by the hundred a second."""
    requests_unauthorised: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def _add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)


@dataclass(frozen=True, slots=True, kw_only=True)
class ForwarderConfig:
    """Where and how to forward accepted bodies.

    ``headers`` are added to every forwarded request (e.g. the upstream's API key); of the
    client's headers only Content-Type and Content-Encoding are passed on.
    """

    url: str
    timeout_s: float = 10.0
    max_queue: int = 256
    headers: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"ForwarderConfig.url must be an http(s) URL, got {self.url!r}")
        if not self.timeout_s > 0:
            raise ConfigError(f"ForwarderConfig.timeout_s must be > 0, got {self.timeout_s}")
        if self.max_queue < 1:
            raise ConfigError(f"ForwarderConfig.max_queue must be >= 1, got {self.max_queue}")


class Forwarder:
    """Sends every accepted OTLP body, bytes unchanged, to an upstream OTLP/HTTP collector.

    One background thread does the sending; ``submit`` never blocks the request: when the bounded
    queue is full the body is dropped and counted. Each body is tried once (the upstream being
    down must not grow memory). Thread-safe. ``start`` and ``shutdown`` are idempotent; after
    ``shutdown`` the forwarder drops everything and cannot be started again.
    """

    def __init__(self, config: ForwarderConfig) -> None:
        self.config = config
        self.sent = 0
        self.failed = 0
        self.dropped = 0
        self.deferred = 0
        """Tries the upstream asked to repeat later (429/503 with Retry-After)."""
        self._queue: queue.Queue[tuple[bytes, dict[str, str]] | None] = queue.Queue(
            config.max_queue
        )
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._abandon = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False

    def submit(self, body: bytes, headers: Mapping[str, str]) -> bool:
        """Queue ``body`` for the upstream; False (and counted as dropped) when it cannot be."""
        if not self._stopping.is_set():
            wanted = {k: v for k in _FORWARDED_HEADERS if (v := headers.get(k)) is not None}
            try:
                self._queue.put_nowait((body, wanted))
                return True
            except queue.Full:
                pass
        with self._lock:
            self.dropped += 1
        return False

    def start(self) -> None:
        """Start the sending thread (a no-op when running)."""
        with self._lock:
            if self._stopping.is_set():
                raise SeedanceError("Forwarder cannot be restarted after shutdown")
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="otlp-forwarder", daemon=True
                )
                self._thread.start()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Send what is queued for up to ``timeout_s``, then drop the rest (harmless twice)."""
        self._stopping.set()
        try:
            self._queue.put_nowait(None)  # wakes the thread; when full it never blocks anyway
        except queue.Full:
            pass
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
        self._abandon.set()
        if thread is None:
            self._drop_queued()

    def __enter__(self) -> Forwarder:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.shutdown(self.config.timeout_s)

    def _drop_queued(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                with self._lock:
                    self.dropped += 1

    def _run(self) -> None:
        headers = dict(self.config.headers)
        with httpx.Client(timeout=self.config.timeout_s) as client:
            while True:
                # Once stopping, never block: the wake-up may not have fit in a full queue.
                try:
                    item = self._queue.get_nowait() if self._stopping.is_set() else self._queue.get()
                except queue.Empty:
                    return
                if item is None:
                    continue
                if self._abandon.is_set():
                    with self._lock:
                        self.dropped += 1
                    continue
                self._deliver(client, item[0], {**item[1], **headers})

    def _deliver(self, client: httpx.Client, body: bytes, headers: dict[str, str]) -> None:
        """Send ``body``; when the upstream answers 429 or 503 with Retry-After, wait that
        long (at most MAX_RETRY_AFTER_S; shutdown cuts it short) and try again, up to
        MAX_ATTEMPTS in all. Bodies arriving meanwhile queue, and past ``max_queue`` are
        dropped and counted: memory stays bounded while the upstream is away."""
        for attempt in range(1, MAX_ATTEMPTS + 1):
            wait_s = self._send(client, body, headers, last=attempt == MAX_ATTEMPTS)
            if wait_s is None or self._stopping.wait(wait_s):
                return

    def _send(self, client: httpx.Client, body: bytes, headers: dict[str, str], *,
              last: bool) -> float | None:
        """One try; the seconds the upstream asked to wait before another (None: done)."""
        wait_s = None
        try:
            response = client.post(self.config.url, content=body, headers=headers)
            ok, why = response.is_success, f"HTTP {response.status_code}"
            if response.status_code in (429, 503):
                wait_s = _retry_after_s(response.headers.get("Retry-After"))
        except Exception as e:  # the loop never dies: any failure is one failed body
            ok, why = False, repr(e)
        if not ok and wait_s is not None and not last:
            with self._lock:
                self.deferred += 1
            return wait_s
        with self._lock:
            if ok:
                self.sent += 1
            else:
                self.failed += 1
        if ok and self._failing:
            logger.info("OTLP forwarding to %s works again", self.config.url)
        elif not ok and not self._failing:
            logger.warning("OTLP forwarding to %s failed (%s); counting failures quietly",
                           self.config.url, why)
        self._failing = not ok
        return None


MAX_ATTEMPTS = 3
MAX_RETRY_AFTER_S = 60.0


def _retry_after_s(header: str | None) -> float | None:
    """Retry-After in seconds (a number or an HTTP date), capped; None when absent or bad."""
    if header is None:
        return None
    try:
        seconds = float(header)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(header)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - time.time()
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)


_T = TypeVar("_T")


@dataclass(frozen=True)
class _Signal(Generic[_T]):
    """What differs between /v1/metrics and /v1/traces: decoders, sink, counts, reply."""

    decode: Mapping[str, Callable[[bytes], _T]]
    sink: Callable[[_T], object]
    count: Callable[[_T], int]
    templated: Callable[[_T], bool]
    unit: str
    reply: Mapping[str, bytes]
    """By encoding: the success reply's body, encoded once, as it never changes."""
    forwarder: Forwarder | None
    peek: Mapping[str, Callable[[bytes], Mapping[str, str] | None]]
    """By encoding: what a body's first resource says, read without decoding it."""


def _encode(message: Message, content_type: str) -> bytes:
    if content_type == JSON:
        return json_format.MessageToJson(message, indent=None).encode()
    return message.SerializeToString()


def _status(code: int, message: str, content_type: str) -> Response:
    """A spec-shaped error: google.rpc.Status (code omitted, as the spec allows) in the
    request's encoding, protobuf when that encoding is unknown."""
    content_type = content_type if content_type in _DECODERS else PROTOBUF
    return Response(_encode(Status(message=message), content_type), status_code=code,
                    media_type=content_type)


def gunzip(data: bytes, max_bytes: int) -> bytes:
    """Decompress gzip (one or more members) incrementally; BodyTooLarge past ``max_bytes``.

    Never holds more than ``max_bytes + 1`` decompressed bytes, whatever the ratio.
    """
    out = bytearray()
    while data:
        d = zlib.decompressobj(_GZIP_WBITS)
        chunk = data
        while chunk and not d.eof:
            out += d.decompress(chunk, max_bytes + 1 - len(out))
            if len(out) > max_bytes:
                raise BodyTooLarge(f"gzip body inflates past the {max_bytes}-byte limit")
            chunk = d.unconsumed_tail
        if not d.eof:
            raise zlib.error("gzip stream is truncated")
        data = d.unused_data
    return bytes(out)


def _replies(message: Message) -> dict[str, bytes]:
    return {content_type: _encode(message, content_type) for content_type in _DECODERS}


async def _read_body(request: Request, max_bytes: int) -> bytes:
    """The body, held to ``max_bytes`` as it arrives; a body that comes in one piece (an
    export, mostly) is not copied again."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise BodyTooLarge(f"Content-Length {declared} is over the {max_bytes}-byte limit")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise BodyTooLarge(f"body is over the {max_bytes}-byte limit")
        if chunk:  # the stream ends with b""; a join of one chunk returns it uncopied
            chunks.append(chunk)
    return b"".join(chunks)


def otlp_router(
    sink: Callable[[DecodedMetrics], None],
    *,
    max_body_bytes: int = 8 * 2**20,
    forwarder: Forwarder | None = None,
    stats: ReceiverStats | None = None,
    span_sink: Callable[[list[SpanRecord]], object] | None = None,
    traces_forwarder: Forwarder | None = None,
    ingest_token: str | None = None,
    workers: int = INGEST_WORKERS,
    admit: Callable[[Callable[[], Mapping[str, str] | None]], None] | None = None,
) -> APIRouter:
    """An APIRouter serving ``POST /v1/metrics`` and, when ``span_sink`` is given,
    ``POST /v1/traces``; every decoded request goes to ``sink`` (or ``span_sink``).

    A sink runs in a worker thread, one call per request, up to ``workers`` at once (so it
    must be thread-safe, as ``TimeSeriesStore.write`` and ``SpanStore.write`` are); if it
    raises, the client gets 503 and retries. Accepted bodies also go to ``forwarder`` (metrics)
    or ``traces_forwarder`` when given (the caller starts and shuts them down). Both endpoints
    follow the same rules: encodings, gzip, size limits and status codes. Pass ``stats`` to
    read the counters. With ``ingest_token``, a request without ``Authorization: Bearer
    <ingest_token>`` gets 401 and nothing of it is read (OTel exporters send it from
    ``OTEL_EXPORTER_OTLP_HEADERS``). ``admit``, when given, sees a metrics body before it is
    decoded, as a call that reads its first resource's string attributes (None when it
    cannot): raising what a sink raises turns the request away as the sink would, so a sender
    over its share does not cost a decode on every retry.
    """
    if max_body_bytes < 1:
        raise ValueError(f"otlp_router max_body_bytes must be >= 1, got {max_body_bytes}")
    if workers < 1:
        raise ValueError(f"otlp_router workers must be >= 1, got {workers}")
    counters = stats if stats is not None else ReceiverStats()
    # its own threads: ingest never waits on API calls, and runs at the background niceness
    threads = background_pool(workers, name="otlp-ingest")
    router = APIRouter()

    def reject(code: int, message: str, content_type: str, **counts: int) -> Response:
        counters._add(requests_rejected=1, **counts)
        return _status(code, message, content_type)

    expected = None if ingest_token is None else f"Bearer {ingest_token}".encode()

    async def receive(request: Request, signal: _Signal[_T]) -> Response:
        content_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if expected is not None and not hmac.compare_digest(
                request.headers.get("authorization", "").encode(), expected):
            counters._add(requests_unauthorised=1)
            return reject(401, "OTLP ingest needs the ingest token: set "
                          "OTEL_EXPORTER_OTLP_HEADERS=Authorization=Bearer%20<token>",
                          content_type)
        if content_type not in _DECODERS:
            return reject(415, f"Content-Type must be {PROTOBUF} or {JSON}, got "
                          f"{content_type or 'none'!r}", content_type)
        encoding = request.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("gzip", "identity", ""):
            return reject(415, f"Content-Encoding must be gzip or identity, got {encoding!r}",
                          content_type)

        def decode_and_sink(raw: bytes) -> tuple[int, bool, Exception | None]:
            """The items decoded, whether from a template, and the sink's failure (None:
            taken); one trip to a worker thread for all, as each trip is a thread hand-off on
            every request."""
            body = gunzip(raw, max_body_bytes) if encoding == "gzip" else raw
            peek = signal.peek.get(content_type)
            if admit is not None and peek is not None:
                try:
                    admit(lambda: peek(body))
                except Exception as e:  # turned away before the decode: its size is unknown
                    return 0, False, e
            decoded = signal.decode[content_type](body)
            try:
                signal.sink(decoded)
            except Exception as e:  # the receiver never dies of its sink; the client retries
                return signal.count(decoded), False, e
            return signal.count(decoded), signal.templated(decoded), None

        try:
            raw = await _read_body(request, max_body_bytes)
            counters._add(bytes_received=len(raw))
            items, templated, failed = await asyncio.get_running_loop().run_in_executor(
                threads, decode_and_sink, raw)
        except BodyTooLarge as e:
            return reject(413, str(e), content_type)
        except zlib.error as e:
            return reject(400, f"bad gzip body: {e}", content_type)
        except OtlpDecodeError as e:
            return reject(400, str(e), content_type)
        except ClientDisconnect:
            counters._add(requests_rejected=1)
            return Response(status_code=400)
        if failed is not None:
            status = getattr(failed, "http_status", 503)
            if status == 429:  # the sink asks this sender to slow down: flow, not failure
                logger.debug("OTLP %s sink throttled %d items: %s", signal.unit, items, failed)
                counters._add(requests_throttled=1)
            else:
                logger.error("OTLP %s sink failed on %d items", signal.unit, items,
                             exc_info=failed)
                counters._add(sink_errors=1)
            response = reject(status,
                              f"sink failed, retry later: {failed}", content_type,
                              **{f"{signal.unit}_rejected": items})
            # a sink that knows when to come back (a store whose disk is full) says so;
            # OTLP exporters honour Retry-After on 503
            response.headers["Retry-After"] = str(getattr(failed, "retry_after_s", 1))
            return response
        counters._add(requests_accepted=1, requests_templated=int(templated),
                      **{f"{signal.unit}_accepted": items})
        if signal.forwarder is not None:
            signal.forwarder.submit(raw, request.headers)
        return Response(signal.reply[content_type], media_type=content_type)

    metrics = _Signal(
        decode={PROTOBUF: protobuf_templates(decode_protobuf).decode,
                JSON: json_templates(JsonShapes().decode, points_from_json).decode},
        sink=sink, count=len, templated=lambda d: d.shape is not None, unit="points",
        reply=_replies(ExportMetricsServiceResponse()), forwarder=forwarder,
        peek={PROTOBUF: first_resource_strings})

    @router.post("/v1/metrics")
    async def export_metrics(request: Request) -> Response:
        return await receive(request, metrics)

    if span_sink is not None:
        traces = _Signal(
            decode={PROTOBUF: lambda b: spans_from_request(decode_traces_protobuf(b)),
                    JSON: lambda b: spans_from_request(decode_traces_json(b))},
            sink=span_sink, count=len, templated=lambda _: False, unit="spans",
            reply=_replies(ExportTraceServiceResponse()),
            forwarder=traces_forwarder, peek={})

        @router.post("/v1/traces")
        async def export_traces(request: Request) -> Response:
            return await receive(request, traces)

    return router
