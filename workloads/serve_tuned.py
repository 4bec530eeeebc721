"""The demo serving job under a live tuner: one replica, closed-loop load, a knob lease.

``python -m workloads.serve_tuned --sidecar http://127.0.0.1:4318 --job serve --duration-s 240``
serves the small GPT (``workloads.serve.Engine``) and holds a knob lease on the sidecar
(``tuner.job.attach_serving``, kind ``serve``) over the KV bit widths and the prefix cache
(``KNOBS``, with ``serving.step_delay_s``, an INJECTED per-step delay an operator can
turn on to make the replica slow on purpose); its launch values (``--kv-bits``, ``--capacity-entries``, ...) are the baseline it
proposes. Between decode steps the newest config takes effect; every metric point carries its
version and goes to the sidecar over OTLP.

Load (``closed_loop``): requests come from the seeded load generator (``workloads.loadgen``:
the Zipf mix of shared prefixes, prompt and output lengths); arrival times are ignored and
``concurrency`` requests are in flight at every moment, a finished one replaced at once. The
replica is always busy, so its throughput (generated tokens/s) is what a config is worth, and a
request's latency includes its wait for a batch slot, as a saturated server's does. Nothing is
simulated.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from collectors import ConfigError, TelemetryConfig, setup_telemetry
from collectors.torch_fingerprint import job_fingerprint
from tuner import Knob
from tuner.job import KV_BITS_KNOBS, attach_serving
from tuner.prefix_cache import PREFIX_CACHE_KNOBS, PrefixCacheConfig
from workloads import loadgen
from workloads.gpt import GPTConfig
from workloads.serve import build_model, quantile
from workloads.serve_engine import Engine, ReplicaConfig, quantized_cache_factory

log = logging.getLogger(__name__)

MODEL = GPTConfig(n_layer=4, n_head=4, n_embd=128)
"""Small enough for a shared 2-core box."""
STEP_DELAY_KNOB = Knob(
    name="serving.step_delay_s", default=0.0, low=0.0, high=1.0, risk="high", searchable=False,
    description="INJECTED sleep after every decode step: a slow replica on demand (demo/test)")
KNOBS = (*KV_BITS_KNOBS, *PREFIX_CACHE_KNOBS, STEP_DELAY_KNOB)
"""What one in-process replica applies (a launcher with a router would add ROUTING_KNOBS)."""


@dataclass(frozen=True, kw_only=True)
class TunedConfig:
    """The job at launch: its load, its replica and KV settings (the baseline it proposes)."""

    load: loadgen.LoadConfig = dataclasses.field(default_factory=loadgen.LoadConfig)
    concurrency: int = 16
    max_batch: int = 8
    kv_bits: tuple[int, int] = (8, 8)
    prefix_cache: PrefixCacheConfig = dataclasses.field(default_factory=PrefixCacheConfig)
    quality_every: int = 4
    quality_min_tokens: int = 128
    model: GPTConfig = MODEL
    model_seed: int = 0
    threads: int = 1

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ConfigError(f"TunedConfig.concurrency must be >= 1, got {self.concurrency}")

    @property
    def knob_values(self) -> dict[str, Any]:
        """The launch values as knob values (the baseline the job proposes)."""
        cache = self.prefix_cache
        return {"kv.key_bits": self.kv_bits[0], "kv.value_bits": self.kv_bits[1],
                "prefix_cache.policy": cache.policy,
                "prefix_cache.capacity_entries": cache.capacity_entries,
                "prefix_cache.capacity_mib": cache.capacity_bytes / 2**20,
                "prefix_cache.pin_top_k": cache.pin_top_k,
                "prefix_cache.prewarm_top_k": cache.prewarm_top_k, "serving.step_delay_s": 0.0}


def build_engine(config: TunedConfig, **kwargs: Any) -> Engine:
    """The replica at its launch config (``kwargs`` go to ``Engine``: meter, ...)."""
    torch.set_num_threads(config.threads)
    factory = quantized_cache_factory(config.model, key_bits=config.kv_bits[0],
                                      value_bits=config.kv_bits[1], group_size=32,
                                      residual_tokens=16)
    return Engine(build_model(config.model, config.model_seed), factory, ReplicaConfig(
        max_batch=config.max_batch, prefix_cache=config.prefix_cache,
        quality_every=config.quality_every, quality_min_tokens=config.quality_min_tokens,
        kv_bits=config.kv_bits), **kwargs)


def requests(load: loadgen.LoadConfig) -> Iterator[loadgen.Request]:
    """The generator's requests, trace after trace (seed, seed + 1, ...), ids unique."""
    ids = itertools.count()
    for n in itertools.count():
        for r in loadgen.generate(dataclasses.replace(load, seed=load.seed + n)):
            yield dataclasses.replace(r, id=next(ids))


def closed_loop(engine: Engine, source: Iterator[loadgen.Request], *, duration_s: float,
                concurrency: int, between_steps: Callable[[], object] | None = None,
                stop: threading.Event | None = None, warmup_s: float = 0.0) -> dict[str, Any]:
    """Keep ``concurrency`` requests in flight for ``warmup_s`` + ``duration_s``; what it
    measured in the last ``duration_s`` (after the warm-up the prefix cache holds what the
    load keeps asking for, as in a server that has run a while)."""
    started: dict[int, float] = {}
    latencies: list[float] = []
    tokens = 0

    def submit() -> None:
        request = next(source)
        started[request.id] = time.monotonic()
        engine.submit(request)

    t0 = time.monotonic() + warmup_s
    for _ in range(concurrency):
        submit()
    while time.monotonic() - t0 < duration_s and not (stop is not None and stop.is_set()):
        if between_steps is not None:
            between_steps()
        for done in engine.step():
            latency = time.monotonic() - started.pop(done.id)
            if time.monotonic() >= t0:
                latencies.append(latency)
                tokens += len(done.tokens)
            submit()
    elapsed_s = max(0.0, time.monotonic() - t0)  # 0 when stopped inside the warm-up
    lat = np.array(latencies)
    return {"requests": len(lat), "tokens": tokens, "elapsed_s": elapsed_s,
            "tokens_per_s": tokens / elapsed_s if elapsed_s else float("nan"),
            "p50_s": quantile(lat, 0.5), "p99_s": quantile(lat, 0.99), "hit_rate": engine.prefix_cache.stats().hit_rate,
            "token_agreement": (sum(engine._checked) / len(engine._checked)
                                if engine._checked else None)}


def serve(config: TunedConfig, *, sidecar: str | None, job: str, duration_s: float,
          export_interval_s: float = 1.0, lease_ttl_s: float | None = None,
          stop: threading.Event | None = None) -> dict[str, Any]:
    """Serve under the lease for ``duration_s`` (or until ``stop``); a summary."""
    telemetry = setup_telemetry(TelemetryConfig(
        job=job, rank=0, otlp_endpoint=sidecar, otlp_protocol="http/protobuf",
        export_interval_s=export_interval_s))
    engine = build_engine(config, meter=telemetry.meter("workloads.serve_tuned"))
    session = attach_serving(job=job, sidecar=sidecar, apply=engine.apply_knobs, knobs=KNOBS,
                             defaults=config.knob_values, lease_ttl_s=lease_ttl_s,
                             fingerprint=job_fingerprint(engine.model) if sidecar else None)
    engine.instrumentation.config_version = lambda: session.version
    try:
        summary = closed_loop(engine, requests(config.load), duration_s=duration_s,
                              concurrency=config.concurrency, between_steps=session.boundary,
                              stop=stop)
    finally:
        session.close()
        telemetry.shutdown()
    return {**summary, "switches": session.switches, "final": session.values}


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: serve under the sidecar's lease, print the JSON summary."""
    p = argparse.ArgumentParser(prog="python -m workloads.serve_tuned", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sidecar", default=None, help="the sidecar's base URL (none: no lease)")
    p.add_argument("--job", default="serve")
    p.add_argument("--duration-s", type=float, default=240.0)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--kv-bits", type=int, nargs=2, default=(8, 8))
    p.add_argument("--policy", choices=("lru", "pinned"), default="lru")
    p.add_argument("--capacity-entries", type=int, default=16)
    p.add_argument("--quality-every", type=int, default=4)
    p.add_argument("--n-prefixes", type=int, default=64)
    p.add_argument("--zipf-s", type=float, default=1.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--export-interval-s", type=float, default=1.0)
    p.add_argument("--lease-ttl-s", type=float, default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    config = TunedConfig(
        load=loadgen.LoadConfig(n_prefixes=args.n_prefixes, zipf_s=args.zipf_s, seed=args.seed),
        concurrency=args.concurrency, max_batch=args.max_batch,
        kv_bits=(args.kv_bits[0], args.kv_bits[1]), quality_every=args.quality_every,
        prefix_cache=PrefixCacheConfig(policy=args.policy,
                                       capacity_entries=args.capacity_entries))
    summary = serve(config, sidecar=args.sidecar, job=args.job, duration_s=args.duration_s,
                    export_interval_s=args.export_interval_s, lease_ttl_s=args.lease_ttl_s,
                    stop=stop)
    json.dump(summary, sys.stdout, indent=2, default=str)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
