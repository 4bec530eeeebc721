"""The demo training job: a small GPT on generated text, on CPU (or `TrainConfig.device`),
optionally DDP over gloo.

``python -m workloads.train --steps 200 --otlp-endpoint http://127.0.0.1:4318`` trains and
exports the training metrics; ``--ddp 2`` runs two gloo ranks (or start it under torchrun).
The global batch stays fixed whatever the micro-batch size and rank count: every rank draws the
same global batch from the seeded generator, keeps its slice, and accumulates gradients over
``global_batch / (micro_batch * world_size)`` micro-batches.

``--sidecar URL`` holds a knob lease (``tuner.job``): the sidecar may switch the precision of
each module group, the thread count and the micro-batch size at a step boundary (the micro-batch
count is read from the session every step, so the global batch and the tokens per step stay
fixed and throughputs compare). ``--loss-scale`` / ``--loss-scale-growth-interval`` set the
GradScaler's scale and how often it may grow: a small scale with growth off is a job whose scale
has backed off, where a group forced to fp16 underflows (the incident the guardrails handle).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp
from torch import nn

from collectors import SeedanceError, TelemetryConfig, setup_telemetry
from collectors.torch_training import NullTrainingInstrumentation, TrainingInstrumentation
from tuner.job import Session, attach
from workloads.corpus import Corpus, CorpusConfig
from workloads.gpt import GPT, GPTConfig, count_parameters
from workloads.process_group import rank_process_group

log = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor]
PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainConfig:
    """One training run; the defaults give a step of roughly 150-400 ms on 2 CPU cores."""

    steps: int = 200
    global_batch: int = 8
    micro_batch: int = 8
    seq_len: int = 128
    threads: int | None = None
    precision: str = "fp32"
    grad_scaler: bool = False
    loss_scale: float = 2.0**16
    loss_scale_growth_interval: int = 2000
    lr: float = 1e-3
    warmup_steps: int = 10
    grad_clip: float = 1.0
    seed: int = 0
    corpus_bytes: int = 1_000_000
    world_size: int = 1
    device: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("steps", "global_batch", "micro_batch", "seq_len", "world_size",
                     "corpus_bytes"):
            if getattr(self, name) <= 0:
                raise SeedanceError(f"TrainConfig.{name} must be positive")
        if self.threads is not None and self.threads <= 0:
            raise SeedanceError(f"TrainConfig.threads must be positive, got {self.threads}")
        if self.precision not in PRECISIONS:
            raise SeedanceError(
                f"TrainConfig.precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.global_batch % (self.micro_batch * self.world_size):
            raise SeedanceError(
                f"TrainConfig.global_batch ({self.global_batch}) must be a multiple of "
                f"micro_batch x world_size ({self.micro_batch} x {self.world_size})")
        if not self.loss_scale > 0 or self.loss_scale_growth_interval < 1:
            raise SeedanceError("TrainConfig.loss_scale must be > 0 and "
                                "loss_scale_growth_interval >= 1")
        try:
            torch.device(self.device)
        except RuntimeError as e:
            raise SeedanceError(f"TrainConfig.device {self.device!r} is not a torch device: "
                                f"{e}") from e
        if self.lr <= 0 or self.warmup_steps < 0 or self.grad_clip < 0:
            raise SeedanceError("TrainConfig.lr must be > 0, warmup_steps and grad_clip >= 0")

    @property
    def accumulation(self) -> int:
        """Micro-batches per rank per step that make up the global batch."""
        return self.global_batch // (self.micro_batch * self.world_size)


class Trainer:
    """Model, optimizer, data and one ``step()``; instrumentation is passed per step."""

    def __init__(self, config: TrainConfig, *, model_config: GPTConfig | None = None,
                 rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        torch.manual_seed(config.seed)
        model_config = model_config or GPTConfig(block_size=max(128, config.seq_len))
        self.corpus = Corpus.generate(CorpusConfig(n_bytes=config.corpus_bytes, seed=config.seed))
        self.device = torch.device(config.device)
        self.model = GPT(model_config).to(self.device)
        self.ddp = (nn.parallel.DistributedDataParallel(self.model) if config.world_size > 1
                    else None)
        self.module: nn.Module = self.model if self.ddp is None else self.ddp
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr,
                                           weight_decay=0.1)
        warmup = max(1, config.warmup_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup))
        self.scaler = torch.amp.GradScaler(
            self.device.type, init_scale=config.loss_scale,
            growth_interval=config.loss_scale_growth_interval, enabled=config.grad_scaler)
        self.data_generator = torch.Generator().manual_seed(config.seed)
        self.steps_done = 0

    def rank_batch(self) -> Batch:
        """This rank's slice of the next global batch."""
        c = self.config
        x, y = Corpus.batch(self.corpus.train, batch_size=c.global_batch, seq_len=c.seq_len,
                            generator=self.data_generator)
        per_rank = c.global_batch // c.world_size
        x, y = (t[self.rank * per_rank:(self.rank + 1) * per_rank].to(self.device)
                for t in (x, y))
        return x, y

    def next_batch(self, micro_batches: int | None = None) -> list[Batch]:
        """This rank's slice of the next global batch in ``micro_batches`` micro-batches
        (default: ``config.accumulation``)."""
        x, y = self.rank_batch()
        n = micro_batches or self.config.accumulation
        return list(zip(x.chunk(n), y.chunk(n), strict=True))

    def forward_backward(self, micro_batches: Sequence[Batch]) -> torch.Tensor:
        """Accumulates the gradient of the mean loss over the micro-batches; returns that loss."""
        total = torch.zeros((), device=self.device)
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16,
                                  enabled=self.config.precision == "bf16")
        for i, (x, y) in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            sync = (self.ddp.no_sync() if self.ddp is not None and not last
                    else contextlib.nullcontext())
            with sync:
                with autocast:
                    loss = self.module(x, y) / len(micro_batches)
                self.scaler.scale(loss).backward()
            total += loss.detach().float()
        return total

    def optimizer_step(self) -> None:
        """Apply the accumulated gradients (skipped on a scaler overflow); step the LR schedule."""
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.steps_done += 1

    def step(self, instr: TrainingInstrumentation | NullTrainingInstrumentation | Session
             ) -> torch.Tensor:
        """One optimizer step over one global batch; returns this rank's mean loss."""
        c = self.config
        tokens = (c.global_batch // c.world_size) * c.seq_len
        with instr.data_wait():
            x, y = self.rank_batch()
        with instr.step(tokens=tokens, samples=tokens // c.seq_len):
            # read inside the step: the session applies a new micro_batch at the boundary
            n = (instr.micro_batches(c.global_batch) if isinstance(instr, Session)
                 and "micro_batch" in instr.values else c.accumulation)
            loss = self.forward_backward(list(zip(x.chunk(n), y.chunk(n), strict=True)))
            self.scaler.unscale_(self.optimizer)
            instr.after_backward()
            if self.config.grad_clip:
                nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
            self.optimizer_step()
            instr.record_loss(loss)
        return loss

    @torch.no_grad()
    def evaluate(self, *, batches: int = 4) -> float:
        """Mean loss on held-out text (fixed windows, so runs compare)."""
        self.model.eval()
        g = torch.Generator().manual_seed(1234)
        losses = [
            float(self.model(*(t.to(self.device) for t in Corpus.batch(
                self.corpus.held_out, batch_size=8, seq_len=self.config.seq_len, generator=g))))
            for _ in range(batches)
        ]
        self.model.train()
        return sum(losses) / len(losses)


def run(config: TrainConfig, *, rank: int = 0, job: str = "train",
        otlp_endpoint: str | None = None, export_interval_s: float = 1.0,
        seconds: float | None = None, log_every: int = 10,
        sidecar: str | None = None, lease_ttl_s: float | None = None) -> dict[str, float]:
    """Trains for ``config.steps`` (or until ``seconds`` pass); returns a short summary.

    With ``sidecar`` (its base URL) the job holds a knob lease (``tuner.job``): the session
    exports the metrics to the sidecar and applies the configs it is sent at step boundaries.
    """
    trainer = Trainer(config, rank=rank)
    telemetry = None
    instr: TrainingInstrumentation | NullTrainingInstrumentation | Session = (
        NullTrainingInstrumentation())
    if sidecar:
        instr = attach(trainer.module, trainer.optimizer, job=job, sidecar=sidecar,
                       grad_scaler=trainer.scaler, export_interval_s=export_interval_s,
                       global_batch=config.global_batch, micro_batch=config.micro_batch,
                       lease_ttl_s=lease_ttl_s)
    elif otlp_endpoint:
        telemetry = setup_telemetry(TelemetryConfig(
            job=job, rank=rank, otlp_endpoint=otlp_endpoint,
            otlp_protocol="http/protobuf", export_interval_s=export_interval_s))
        instr = TrainingInstrumentation(trainer.model, trainer.optimizer,
                                        telemetry.meter("workloads.train"),
                                        grad_scaler=trainer.scaler)
    if rank == 0:
        print(f"GPT {count_parameters(trainer.model) / 1e6:.2f}M parameters, "
              f"{len(trainer.corpus.train)} train bytes (generated text), "
              f"accumulation {config.accumulation}, world size {config.world_size}", flush=True)
    start = time.perf_counter()
    first_loss = math.nan
    loss = math.nan
    try:
        while trainer.steps_done < config.steps:
            if seconds is not None and time.perf_counter() - start >= seconds:
                break
            loss = float(trainer.step(instr))
            if trainer.steps_done == 1:
                first_loss = loss
            if rank == 0 and trainer.steps_done % log_every == 0:
                elapsed = time.perf_counter() - start
                print(f"step {trainer.steps_done} loss {loss:.4f} "
                      f"{elapsed / trainer.steps_done * 1e3:.0f} ms/step", flush=True)
    finally:
        if isinstance(instr, Session):
            instr.close()
        else:
            instr.flush()
        if telemetry is not None:
            telemetry.shutdown()
    held_out = trainer.evaluate()
    if rank == 0:
        print(f"done: {trainer.steps_done} steps, first loss {first_loss:.4f}, last loss "
              f"{loss:.4f}, held-out loss {held_out:.4f}", flush=True)
    return {"steps": trainer.steps_done, "first_loss": first_loss, "loss": loss,
            "held_out_loss": held_out}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ddp_worker(rank: int, world_size: int, config: TrainConfig, kwargs: dict) -> None:
    with rank_process_group("gloo", rank=rank, world_size=world_size):
        run(config, rank=rank, **kwargs)


def main(argv: Sequence[str] | None = None) -> None:
    """The command line: one process, ``--ddp N`` spawned gloo ranks, or a torchrun rank."""
    d = TrainConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--seconds", type=float, default=None, help="stop after this wall time")
    p.add_argument("--global-batch", type=int, default=d.global_batch)
    p.add_argument("--micro-batch", type=int, default=d.micro_batch)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--precision", choices=PRECISIONS, default=d.precision)
    p.add_argument("--grad-scaler", action="store_true")
    p.add_argument("--loss-scale", type=float, default=d.loss_scale,
                   help="the GradScaler's initial scale")
    p.add_argument("--loss-scale-growth-interval", type=int,
                   default=d.loss_scale_growth_interval,
                   help="steps without overflow before the scale grows (huge: never)")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--ddp", type=int, default=1, metavar="N", help="spawn N gloo ranks")
    p.add_argument("--job", default="train", help="service.name of the exported metrics")
    p.add_argument("--otlp-endpoint", default=None,
                   help="OTLP/HTTP base URL (or .../v1/metrics); metrics are off without it")
    p.add_argument("--export-interval-s", type=float, default=1.0)
    p.add_argument("--sidecar", default=None, metavar="URL",
                   help="sidecar base URL: hold a knob lease there and export metrics to it")
    p.add_argument("--lease-ttl-s", type=float, default=None,
                   help="knob lease TTL to ask the sidecar for (default: the sidecar's)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per lease poll otherwise
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world_size = int(os.environ["WORLD_SIZE"]) if torchrun else a.ddp
    config = TrainConfig(
        steps=a.steps if a.seconds is None else 10**9, global_batch=a.global_batch,
        micro_batch=a.micro_batch, seq_len=a.seq_len, threads=a.threads,
        precision=a.precision, grad_scaler=a.grad_scaler, loss_scale=a.loss_scale,
        loss_scale_growth_interval=a.loss_scale_growth_interval, lr=a.lr, seed=a.seed,
        world_size=world_size)
    kwargs = {"job": a.job, "otlp_endpoint": a.otlp_endpoint,
              "export_interval_s": a.export_interval_s, "seconds": a.seconds,
              "sidecar": a.sidecar, "lease_ttl_s": a.lease_ttl_s}
    if torchrun:
        _ddp_worker(int(os.environ["RANK"]), world_size, config, kwargs)
    elif world_size > 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        mp.spawn(_ddp_worker, args=(world_size, config, kwargs), nprocs=world_size)
    else:
        run(config, **kwargs)


if __name__ == "__main__":
    main()
