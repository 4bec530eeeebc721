"""Instrumentation a decode server calls: request latencies, throughput, batch, KV cache.

Latencies follow the OpenTelemetry GenAI server metrics (``gen_ai.server.*``, seconds, with the
bucket boundaries the semantic conventions advise):

- time to first token: ``first_token - request_started``;
- time per output token: ``(request_finished - first_token) / (output_tokens - 1)``, recorded
  for requests with at least two output tokens (the first token is TTFT's);
- request duration: ``request_finished - request_started``.

A request whose config version changed between its start and a measurement is left out of that
measurement: it ran under neither config alone (the architecture's "a window that straddles a
change is counted for neither side").

Import this module only in the job: it imports torch (for CUDA-synchronised KV timing and for
measuring KV-cache tensors).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
from opentelemetry.metrics import CallbackOptions, Histogram, Meter, Observation

from collectors._catalogue import BY_NAME
from collectors._errors import SeedanceError
from collectors._points import CONFIG_VERSION_ATTR
from collectors.names import (
    ATTR_SEEDANCE_KV_PART,
    GEN_AI_SERVER_REQUEST_DURATION,
    GEN_AI_SERVER_TIME_PER_OUTPUT_TOKEN,
    GEN_AI_SERVER_TIME_TO_FIRST_TOKEN,
    SERVE_BATCH_SIZE,
    SERVE_GENERATION_TOKENS,
    SERVE_KV_CACHE_BITS,
    SERVE_KV_CACHE_BYTES,
    SERVE_KV_DEQUANTIZE_DURATION,
    SERVE_KV_QUANTIZE_DURATION,
    SERVE_PREFIX_CACHE_DISTINCT_PREFIXES,
    SERVE_PREFIX_CACHE_EVICTIONS,
    SERVE_PREFIX_CACHE_HITS,
    SERVE_PREFIX_CACHE_MISSES,
    SERVE_PREFIX_CACHE_QUERIES,
    SERVE_QUALITY_AGREEING_TOKENS,
    SERVE_QUALITY_CHECKED_TOKENS,
    SERVE_QUEUE_DEPTH,
    SERVE_TOKENS_PER_SECOND,
)

__all__ = ["ServingInstrumentation", "tensor_bytes"]

_LOG = logging.getLogger(__name__)

KV_PART_ATTR = ATTR_SEEDANCE_KV_PART

_TTFT = GEN_AI_SERVER_TIME_TO_FIRST_TOKEN
_TPOT = GEN_AI_SERVER_TIME_PER_OUTPUT_TOKEN
_E2E = GEN_AI_SERVER_REQUEST_DURATION
_TOKENS_PER_S = SERVE_TOKENS_PER_SECOND
_BATCH = SERVE_BATCH_SIZE
_QUEUE = SERVE_QUEUE_DEPTH
_KV_BYTES = SERVE_KV_CACHE_BYTES
_KV_BITS = SERVE_KV_CACHE_BITS
_QUANTIZE = SERVE_KV_QUANTIZE_DURATION
_DEQUANTIZE = SERVE_KV_DEQUANTIZE_DURATION
_HITS = SERVE_PREFIX_CACHE_HITS
_QUERIES = SERVE_PREFIX_CACHE_QUERIES
_MISSES = SERVE_PREFIX_CACHE_MISSES
_EVICTIONS = SERVE_PREFIX_CACHE_EVICTIONS
_DISTINCT = SERVE_PREFIX_CACHE_DISTINCT_PREFIXES
_GENERATED = SERVE_GENERATION_TOKENS
_CHECKED = SERVE_QUALITY_CHECKED_TOKENS
_AGREEING = SERVE_QUALITY_AGREEING_TOKENS

# Advised by the GenAI semantic conventions for these three metrics.
_TTFT_BOUNDS_S = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
)
_TPOT_BOUNDS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BOUNDS_S = (
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
)
# KV (de)quantisation of one layer or one decode step: microseconds to a second.
_KV_CODEC_BOUNDS_S = (
    1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 0.1, 1.0,
)


def _described(name: str) -> dict[str, str]:
    """Unit and description from the catalogue, so both are spelled once."""
    return {"unit": BY_NAME[name].unit, "description": BY_NAME[name].description}


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes the tensors' elements occupy (``numel * element_size``), e.g. a KV cache's."""
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(slots=True, kw_only=True)
class _Request:
    started_s: float
    config_version: int
    first_token_s: float | None = None


class ServingInstrumentation:
    """Records one decode server's request lifecycle, load and KV-cache state.

    Thread-safe: the request map, the token window and the config version are guarded by one
    lock, and OpenTelemetry instruments are thread-safe themselves. Calls about an unknown
    request id are logged and ignored, so a bookkeeping slip never fails a request.

    Args:
        meter: where the instruments are created.
        config_version: the config version in force: an int or a callable returning one (as
            for the training instrumentation), read at each event; it can be assigned later.
        attributes: added to every point (e.g. ``seedance.rank``).
        clock: monotonic seconds; injectable so tests drive time.
        rate_window_s: tokens/s is the tokens generated in the last ``rate_window_s`` seconds
            (less while the server is younger than that), read when a metric reader collects.
    """

    def __init__(
        self,
        meter: Meter,
        *,
        config_version: Callable[[], int] | int,
        attributes: Mapping[str, str | int] | None = None,
        clock: Callable[[], float] = time.monotonic,
        rate_window_s: float = 10.0,
    ) -> None:
        if rate_window_s <= 0:
            raise SeedanceError(f"rate_window_s must be > 0, got {rate_window_s}")
        self._clock = clock
        self._rate_window_s = rate_window_s
        self._base_attributes = dict(attributes or {})
        self._lock = threading.Lock()
        self.config_version = config_version
        self._requests: dict[Hashable, _Request] = {}
        self._token_times_s: deque[float] = deque()
        self._created_s = clock()

        def histogram(name: str, bounds_s: tuple[float, ...]) -> Histogram:
            return meter.create_histogram(
                name, **_described(name), explicit_bucket_boundaries_advisory=list(bounds_s)
            )

        self._ttft = histogram(_TTFT, _TTFT_BOUNDS_S)
        self._tpot = histogram(_TPOT, _TPOT_BOUNDS_S)
        self._e2e = histogram(_E2E, _E2E_BOUNDS_S)
        self._quantize = histogram(_QUANTIZE, _KV_CODEC_BOUNDS_S)
        self._dequantize = histogram(_DEQUANTIZE, _KV_CODEC_BOUNDS_S)
        self._batch = meter.create_gauge(_BATCH, **_described(_BATCH))
        self._queue = meter.create_gauge(_QUEUE, **_described(_QUEUE))
        self._kv_bytes = meter.create_gauge(_KV_BYTES, **_described(_KV_BYTES))
        self._kv_bits = meter.create_gauge(_KV_BITS, **_described(_KV_BITS))
        self._hits = meter.create_counter(_HITS, **_described(_HITS))
        self._queries = meter.create_counter(_QUERIES, **_described(_QUERIES))
        self._misses = meter.create_counter(_MISSES, **_described(_MISSES))
        self._evictions = meter.create_counter(_EVICTIONS, **_described(_EVICTIONS))
        self._distinct = meter.create_gauge(_DISTINCT, **_described(_DISTINCT))
        self._generated = meter.create_counter(_GENERATED, **_described(_GENERATED))
        self._checked = meter.create_counter(_CHECKED, **_described(_CHECKED))
        self._agreeing = meter.create_counter(_AGREEING, **_described(_AGREEING))
        meter.create_observable_gauge(
            _TOKENS_PER_S, callbacks=[self._observe_tokens_per_s],
            **_described(_TOKENS_PER_S),
        )

    @property
    def config_version(self) -> int:
        """The config version in force now."""
        return int(self._version_source())

    @config_version.setter
    def config_version(self, value: Callable[[], int] | int) -> None:
        self._version_source = value if callable(value) else (lambda v=int(value): v)

    def _attributes(self, version: int | None = None) -> dict[str, str | int]:
        return {
            **self._base_attributes,
            CONFIG_VERSION_ATTR: self.config_version if version is None else version,
        }

    # -- request lifecycle -------------------------------------------------------------------

    def request_started(self, req_id: Hashable) -> None:
        """The request arrived (its latency clock starts here, queueing included)."""
        now = self._clock()
        version = self.config_version
        with self._lock:
            if req_id in self._requests:
                _LOG.warning("request %r started twice; keeping the first start", req_id)
                return
            self._requests[req_id] = _Request(started_s=now, config_version=version)

    def first_token(self, req_id: Hashable) -> None:
        """The request's first output token is ready."""
        now = self._clock()
        version = self.config_version
        with self._lock:
            request = self._requests.get(req_id)
            if request is None or request.first_token_s is not None:
                _LOG.warning("first_token for %r ignored: unknown request or a second time",
                             req_id)
                return
            request.first_token_s = now
            self._note_token(now)
        self._generated.add(1, self._attributes(version))
        if request.config_version == version:
            self._ttft.record(now - request.started_s, self._attributes(version))

    def token(self, req_id: Hashable) -> None:
        """One more output token after the first (counts towards tokens/s)."""
        now = self._clock()
        with self._lock:
            request = self._requests.get(req_id)
            if request is None or request.first_token_s is None:
                _LOG.warning("token for %r ignored: unknown request or no first token yet",
                             req_id)
                return
            self._note_token(now)
        self._generated.add(1, self._attributes())

    def _note_token(self, now: float) -> None:
        """Remember a token's time, forgetting those out of the window (call under the lock)."""
        self._token_times_s.append(now)
        self._forget_tokens_before(now - self._rate_window_s)

    def _forget_tokens_before(self, cutoff_s: float) -> None:
        while self._token_times_s and self._token_times_s[0] <= cutoff_s:
            self._token_times_s.popleft()

    def request_finished(self, req_id: Hashable, output_tokens: int) -> None:
        """The request's last token is out; ``output_tokens`` counts all of them."""
        now = self._clock()
        version = self.config_version
        with self._lock:
            request = self._requests.pop(req_id, None)
        if request is None:
            _LOG.warning("request_finished for unknown request %r ignored", req_id)
            return
        if request.config_version != version:
            return  # straddles a config change
        attributes = self._attributes(version)
        self._e2e.record(now - request.started_s, attributes)
        if request.first_token_s is not None and output_tokens > 1:
            self._tpot.record((now - request.first_token_s) / (output_tokens - 1), attributes)

    def _observe_tokens_per_s(self, options: CallbackOptions) -> Iterable[Observation]:
        now = self._clock()
        with self._lock:
            self._forget_tokens_before(now - self._rate_window_s)
            tokens = len(self._token_times_s)
        window_s = min(self._rate_window_s, now - self._created_s)
        return [Observation(tokens / window_s, self._attributes())] if window_s > 0 else []

    def tokens_checked(self, checked: int, agreeing: int, *, version: int | None = None) -> None:
        """Generated tokens checked against a cache-free full-precision forward and how many
        it also picks, counted for ``version`` (default: the one in force). The serving
        guardrail judges a config by these counts, so count only tokens made under it."""
        if not 0 <= agreeing <= checked:
            raise SeedanceError(f"agreeing tokens must be in [0, checked={checked}], "
                                f"got {agreeing}")
        attributes = self._attributes(version)
        self._checked.add(checked, attributes)
        self._agreeing.add(agreeing, attributes)

    # -- load and KV cache -------------------------------------------------------------------

    def set_batch_size(self, requests: int) -> None:
        """Requests in the decode batch now."""
        self._batch.set(requests, self._attributes())

    def set_queue_depth(self, requests: int) -> None:
        """Requests waiting for a batch slot now."""
        self._queue.set(requests, self._attributes())

    def set_kv_cache(self, *, size_bytes: int, key_bits: int, value_bits: int) -> None:
        """KV-cache bytes held (measure them, e.g. ``tensor_bytes``) and bit-width per part."""
        attributes = self._attributes()
        self._kv_bytes.set(size_bytes, attributes)
        for part, bits in (("key", key_bits), ("value", value_bits)):
            self._kv_bits.set(bits, {**attributes, KV_PART_ATTR: part})

    @contextlib.contextmanager
    def quantize(self, device: torch.device | None = None) -> Iterator[None]:
        """Time the block as KV quantisation (see ``_timed`` for CUDA)."""
        with self._timed(self._quantize, device):
            yield

    @contextlib.contextmanager
    def dequantize(self, device: torch.device | None = None) -> Iterator[None]:
        """Time the block as KV dequantisation (see ``_timed`` for CUDA)."""
        with self._timed(self._dequantize, device):
            yield

    @contextlib.contextmanager
    def _timed(self, histogram: Histogram, device: torch.device | None) -> Iterator[None]:
        """Record the block's duration unless it raised.

        CUDA kernels run asynchronously, so for a CUDA ``device`` the device is synchronised
        on entry and exit: the time is then the kernels' time, at the cost of two stalls.
        """
        cuda = device is not None and torch.device(device).type == "cuda"
        if cuda:
            torch.cuda.synchronize(device)
        attributes = self._attributes()
        started_s = self._clock()
        yield
        if cuda:
            torch.cuda.synchronize(device)
        histogram.record(self._clock() - started_s, attributes)

    # -- prefix cache ------------------------------------------------------------------------

    def prefix_cache_hit(self, requests: int = 1) -> None:
        """Look-ups that found a cached prefix (also counted as queries)."""
        attributes = self._attributes()
        self._hits.add(requests, attributes)
        self._queries.add(requests, attributes)

    def prefix_cache_miss(self, requests: int = 1) -> None:
        """Look-ups that found none (also counted as queries)."""
        attributes = self._attributes()
        self._misses.add(requests, attributes)
        self._queries.add(requests, attributes)

    def prefix_cache_evicted(self, entries: int = 1) -> None:
        """Entries evicted from the prefix cache."""
        self._evictions.add(entries, self._attributes())

    def prefix_cache_distinct(self, prefixes: int) -> None:
        """Distinct prefixes among the cache's recent look-ups: no pinned or prewarmed top-k
        above it does anything, so the search keeps those knobs below it."""
        self._distinct.set(prefixes, self._attributes())
