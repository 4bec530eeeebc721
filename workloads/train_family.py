"""Train one model family of ``workloads.families``, attached to a sidecar as a user would.

``python -m workloads.train_family --family vit --sidecar http://127.0.0.1:4318 --job vit
--seconds 600`` is the README's "Attach to your own training loop" around the family: attach
with the global batch, ``session.step``, ``session.micro_batches``, ``record_loss``,
``after_backward``, then the optimizer. Nothing else is passed to ``attach``: the job is a new
user's, and the sidecar's defaults have to do. It prints ``step N loss L T ms/step`` every
``--log-every`` steps (the line ``seedancectl._session`` reads) and stops cleanly on SIGTERM or
SIGINT (at a step boundary; the session is closed so the lease is given back).

``run_steps(family, config, steps)`` runs the SAME step, without a sidecar, under one fixed
config (threads, micro_batch, precision per group): the benchmark's grid and its A/B of the
kept config against the default both measure through it, so the truth and the live job time
the same code.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import logging
import math
import signal
import time
from collections.abc import Iterator, Mapping, Sequence
from types import FrameType
from typing import Any

import torch

from tuner.job import PRECISION_CHOICES, Session, attach
from tuner.precision import PrecisionPolicy, apply_precision
from workloads.families import FAMILIES, Built, family

log = logging.getLogger(__name__)

Config = dict[str, Any]
"""Knob name -> value, as the sidecar's API shows a job's config (``precision.<group>``,
``threads``, ``micro_batch``, and restart-scope knobs that a running job ignores)."""


def train_step(built: Built, session: Session) -> torch.Tensor:
    """One optimizer step over one global batch; returns its mean loss (detached)."""
    with session.data_wait():
        x, y = next(built.batches)
    with session.step(tokens=built.tokens_per_batch, samples=built.global_batch):
        n = session.micro_batches(built.global_batch)  # live knob; the global batch is kept
        total = torch.zeros(())
        for xs, ys in zip(x.chunk(n), y.chunk(n), strict=True):
            loss = built.loss_fn(built.model(xs), ys)
            (loss / n).backward()
            total += loss.detach().float() / n
        session.record_loss(total)
        session.after_backward()
        built.optimizer.step()
        built.optimizer.zero_grad(set_to_none=True)
    return total


# ---- without a sidecar: one fixed config ---------------------------------------------------------


def null_session(built: Built, *, micro_batch: int | None = None) -> Session:
    """The session ``attach`` gives with ``sidecar=None``: the knobs the job declares, at their
    defaults (``micro_batch`` or the family's launch micro-batch), and nothing on the
    network."""
    return attach(built.model, built.optimizer, job=built.family.name, sidecar=None,
                  global_batch=built.global_batch,
                  micro_batch=micro_batch or built.family.launch_micro_batch,
                  module_groups=built.module_groups)


def default_config(built: Built) -> Config:
    """The config the job starts with when a sidecar is attached: the knobs' defaults, with the
    family's launch threads."""
    config = dict(null_session(built).values)
    if built.family.launch_threads is not None and "threads" in config:
        config["threads"] = built.family.launch_threads
    return config


def live_knobs(built: Built) -> dict[str, tuple[Any, ...]]:
    """Live knobs the job declares and their domains (threads as 1..usable CPUs)."""
    space = null_session(built).knobs.searchable()
    out: dict[str, tuple[Any, ...]] = {}
    for name, knob in space.knobs.items():
        if knob.choices is not None:
            out[name] = tuple(knob.choices)
        else:
            assert knob.low is not None and knob.high is not None
            out[name] = tuple(range(int(knob.low), int(knob.high) + 1))
    return out


def spread(values: Sequence[int], most: int) -> list[int]:
    """At most ``most`` of ``values`` (sorted), evenly spaced in log scale, ends included."""
    values = sorted(values)
    if len(values) <= most:
        return values
    if most == 1:
        return [values[-1]]
    logs = [math.log(v) for v in values]
    picks = {min(range(len(values)), key=lambda i: abs(logs[i] - (logs[0] + k * (
        logs[-1] - logs[0]) / (most - 1)))) for k in range(most)}
    return [values[i] for i in sorted(picks)]


def knob_grid(built: Built, *, precisions: Sequence[str] = PRECISION_CHOICES,
              max_micro_batches: int = 4) -> list[Config]:
    """The exhaustive grid over the job's live knobs: threads {1, usable CPUs} x one precision
    for every group at once x up to ``max_micro_batches`` micro-batch sizes (log-spread
    divisors of the global batch, the whole batch included). Every config is a full one (the
    other knobs at their defaults), the default config among them."""
    knobs = live_knobs(built)
    base = default_config(built)
    threads = sorted({min(knobs.get("threads", (1,))), max(knobs.get("threads", (1,)))})
    micro = spread([int(v) for v in knobs["micro_batch"]], max_micro_batches)
    groups = [k for k in knobs if k.startswith("precision.")]
    unknown = set(knobs) - {"threads", "micro_batch", *groups}
    if unknown:
        raise ValueError(f"knob_grid does not know how to cover {sorted(unknown)}")
    grid = [{**base, "threads": t, "micro_batch": m, **{g: p for g in groups}}
            for t, p, m in itertools.product(threads, precisions, micro)]
    if base not in grid:
        grid.insert(0, dict(base))
    return grid


def config_label(config: Mapping[str, Any]) -> str:
    """Short, stable name of a config's live knobs: ``t2/mb8/fp32`` (uniform precision) or
    ``t2/mb8/attention=bf16,ffn=fp32``."""
    precisions = {k.removeprefix("precision."): v for k, v in sorted(config.items())
                  if k.startswith("precision.")}
    kinds = set(precisions.values())
    precision = (kinds.pop() if len(kinds) == 1
                 else ",".join(f"{g}={p}" for g, p in precisions.items()))
    return f"t{config.get('threads', '-')}/mb{config.get('micro_batch', '-')}/{precision}"


@contextlib.contextmanager
def fixed_config(built: Built, config: Mapping[str, Any]) -> Iterator[Session]:
    """A null session under ``config``: threads set, precision hooks on, micro_batch declared;
    everything restored on exit. The same actuators the live session drives."""
    session = null_session(built, micro_batch=int(config.get("micro_batch",
                                                             built.global_batch)))
    groups = session.precision_groups
    precisions = {g: str(config.get(f"precision.{g}", "fp32")) for g in groups}
    threads = torch.get_num_threads()
    handle = None
    try:
        if "threads" in config:
            torch.set_num_threads(int(config["threads"]))
        if any(p != "fp32" for p in precisions.values()):
            handle = apply_precision(built.model, PrecisionPolicy.from_groups(
                groups, precisions))  # type: ignore[arg-type]
        yield session
    finally:
        if handle is not None:
            handle.remove()
        torch.set_num_threads(threads)
        session.close()


def run_steps(family_or_built: str | Built, config: Mapping[str, Any], steps: int, *,
              warmup: int = 0, max_seconds: float | None = None,
              losses: list[float] | None = None,
              warmup_out: list[tuple[int, float]] | None = None) -> list[tuple[int, float]]:
    """``steps`` optimizer steps under one fixed config, no sidecar; (tokens, seconds) per step.

    Pass a ``Built`` to keep training the same model across calls (the benchmark interleaves
    configs on one model); a family name builds a fresh one. ``warmup`` steps run first and are
    not returned (into ``warmup_out`` if given): the first steps after a switch pay for it.
    ``max_seconds`` bounds the call: no new step starts after it, once one step was measured;
    if the warmup alone used it up, none is measured (a config that slow is not worth more).
    ``losses`` collects every step's mean loss, warmup included."""
    built = family(family_or_built).build() if isinstance(family_or_built, str) \
        else family_or_built
    out: list[tuple[int, float]] = []
    began = time.perf_counter()
    with fixed_config(built, config) as session:
        for i in range(warmup + steps):
            elapsed = time.perf_counter() - began
            if max_seconds is not None and elapsed >= max_seconds and (out or 0 < warmup == i):
                break
            start = time.perf_counter()
            loss = train_step(built, session)
            seconds = time.perf_counter() - start
            (out if i >= warmup else warmup_out if warmup_out is not None else []).append(
                (built.tokens_per_batch, seconds))
            if losses is not None:
                losses.append(float(loss))
    return out


# ---- attached to a sidecar -----------------------------------------------------------------------


class _StopFlag:
    """SIGTERM / SIGINT ask the loop to stop at the next step boundary."""

    def __init__(self) -> None:
        self.set = False
        self.signal: int | None = None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.set = True
        self.signal = signum


def run(name: str, *, sidecar: str | None, job: str, seconds: float | None,
        threads: int | None = None, seed: int = 0, log_every: int = 10,
        max_steps: int | None = None) -> dict[str, float]:
    """Trains until ``seconds`` pass, ``max_steps`` are done or a signal; a short summary."""
    built = family(name).build(seed)
    threads = threads if threads is not None else built.family.launch_threads
    if threads is not None:
        torch.set_num_threads(threads)
    session = attach(built.model, built.optimizer, job=job, sidecar=sidecar,
                     global_batch=built.global_batch, micro_batch=built.family.launch_micro_batch,
                     module_groups=built.module_groups)
    stop = _StopFlag()
    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    params = sum(p.numel() for p in built.model.parameters())
    print(f"{name}: {params / 1e6:.2f}M parameters, global batch {built.global_batch}, "
          f"{built.tokens_per_batch} tokens per step ({built.family.token_unit}), "
          f"threads {torch.get_num_threads()}, sidecar {sidecar or 'none'}", flush=True)
    start = time.perf_counter()
    steps = 0
    first = loss = math.nan
    try:
        while not stop.set:
            if seconds is not None and time.perf_counter() - start >= seconds:
                break
            if max_steps is not None and steps >= max_steps:
                break
            loss = float(train_step(built, session))
            steps += 1
            if steps == 1:
                first = loss
            if steps % log_every == 0:
                elapsed = time.perf_counter() - start
                print(f"step {steps} loss {loss:.4f} {elapsed / steps * 1e3:.0f} ms/step",
                      flush=True)
    finally:
        session.close()
        for s, handler in previous.items():
            signal.signal(s, handler)
    why = f"signal {stop.signal}" if stop.signal is not None else "time or step limit"
    print(f"done ({why}): {steps} steps, first loss {first:.4f}, last loss {loss:.4f}",
          flush=True)
    return {"steps": steps, "first_loss": first, "loss": loss}


def main(argv: Sequence[str] | None = None) -> None:
    """The command line: train ``--family`` until ``--seconds`` / ``--steps`` or a signal."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--family", required=True, choices=sorted(FAMILIES))
    p.add_argument("--sidecar", default=None, metavar="URL",
                   help="sidecar base URL (none: train without one)")
    p.add_argument("--job", default=None, help="job name (default: the family's name)")
    p.add_argument("--seconds", type=float, default=None, help="stop after this wall time")
    p.add_argument("--steps", type=int, default=None, help="stop after this many steps")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads at start")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    run(a.family, sidecar=a.sidecar, job=a.job or a.family, seconds=a.seconds,
        threads=a.threads, seed=a.seed, log_every=a.log_every, max_steps=a.steps)


if __name__ == "__main__":
    main()
