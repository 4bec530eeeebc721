"""The five Grafana dashboards: GPUs, training, serving, tuning, findings.

Every expression is written from catalogue names through :mod:`dashboards.grafana._names`; no
Prometheus series or label name is spelled here.
"""

from __future__ import annotations

from collections.abc import Callable

from dashboards.grafana._model import (
    DashboardSpec,
    PanelSpec,
    Query,
    Scope,
    Variable,
    by,
    labels_of,
    legend,
)
from dashboards.grafana._names import prom

JOB_VAR = "job"
GPU_VAR = "gpu"
RANK_VAR = "rank"


def _label_values(name: str, attribute: str, scope: Scope | None = None) -> str:
    """A variable query listing the values of ``attribute`` on metric ``name``."""
    metric = prom(name)
    series = scope.series(metric, metric.series) if scope else metric.series
    return f"label_values({series}, {metric.label(attribute)})"


def _job_variable(name: str) -> Variable:
    return Variable(name=JOB_VAR, label="Job", query=_label_values(name, "service.name"),
                    multi=True)


def _gauges(scope: Scope, title: str, description: str, unit: str,
            *series: tuple[str, tuple[str, ...], str], span: int = 12) -> PanelSpec:
    """A panel of gauges: (metric, legend parts, extra text) each."""
    return PanelSpec(title=title, description=description, unit=unit, span=span, queries=tuple(
        Query(expr=scope.gauge(name), legend=legend(name, *parts, *([extra] if extra else [])))
        for name, parts, extra in series))


def _quantiles(scope: Scope, title: str, description: str, name: str,
               by_attrs: tuple[str, ...], span: int = 12) -> PanelSpec:
    return PanelSpec(title=title, description=description, unit="s", span=span, queries=tuple(
        Query(expr=scope.quantile(q, name, by_attrs), legend=legend(name, *by_attrs, f"p{p}"))
        for q, p in ((0.5, 50), (0.99, 99))))


def gpu_dashboard() -> DashboardSpec:
    scope = Scope((("service.name", JOB_VAR), ("gpu.index", GPU_VAR)))
    gpu = ("host.name", "GPU", "gpu.index")
    up = "hw.gpu.up"
    throttle = "seedance.gpu.throttle_reasons"
    throttle_by = ("service.name", "host.name", "gpu.index")
    reason = prom(throttle).label("reason")
    # No reason active gives no series at all; show that as reason="none" = 0 per GPU.
    throttle_expr = (
        f"{by(throttle, (*throttle_by, 'reason'), 'sum', scope.gauge(throttle))} "
        f"or on ({', '.join(labels_of(throttle, throttle_by))}) "
        f"label_replace({by(up, throttle_by, 'sum', scope.gauge(up))} * 0, "
        f'"{reason}", "none", "", "")')
    return DashboardSpec(
        uid="seedance-gpus", title="seedance / GPUs",
        description="NVML readings the sidecar samples (replayed traces carry "
        "seedance_replayed=\"true\")",
        variables=(
            _job_variable(up),
            Variable(name=GPU_VAR, label="GPU",
                     query=_label_values(up, "gpu.index", Scope((("service.name", JOB_VAR),))),
                     multi=True)),
        rows=[
            ("Health", [
                PanelSpec(title="GPUs up", description="GPUs answering NVML", unit="none",
                          kind="stat", span=6, queries=(
                              Query(expr=f"sum({scope.gauge(up)})", legend="up"),)),
                _gauges(scope, "Up", "1 while the GPU answers NVML, 0 once it is lost", "none",
                        (up, gpu, ""), span=6),
                PanelSpec(title="Throttle reasons", unit="none", span=12,
                          description="Active clock-throttle reasons (none = 0)", queries=(
                              Query(expr=throttle_expr,
                                    legend=legend(throttle, *gpu, "reason")),)),
            ]),
            ("Utilisation and memory", [
                _gauges(scope, "Utilisation", "Fraction of time a kernel ran", "percentunit",
                        ("hw.gpu.utilization", gpu, "")),
                _gauges(scope, "Memory-bandwidth utilisation",
                        "Fraction of time device memory was read or written", "percentunit",
                        ("hw.gpu.memory.utilization", gpu, "")),
                _gauges(scope, "Memory used", "Device memory in use and in total", "bytes",
                        ("hw.gpu.memory.usage", gpu, "used"),
                        ("hw.gpu.memory.limit", gpu, "total")),
            ]),
            ("Interconnect", [
                _gauges(scope, "PCIe throughput", "PCIe throughput per direction and the "
                        "current link's one-direction peak", "Bps",
                        ("hw.gpu.io", (*gpu, "network.io.direction"), ""),
                        ("seedance.gpu.pcie.link.peak_bandwidth", gpu, "peak")),
                _gauges(scope, "NVLink throughput", "Summed over links, where supported",
                        "Bps", ("seedance.gpu.nvlink.throughput",
                                (*gpu, "network.io.direction"), "")),
            ]),
            ("Power, clocks, temperature", [
                _gauges(scope, "Power", "Board power draw and enforced limit", "watt",
                        ("hw.power", gpu, "draw"), ("seedance.gpu.power.limit", gpu, "limit")),
                _gauges(scope, "Clocks", "Current and maximum clocks", "suffix: MHz",
                        ("seedance.gpu.clock", (*gpu, "clock"), ""),
                        ("seedance.gpu.clock.max", (*gpu, "clock"), "max")),
                _gauges(scope, "Temperature", "GPU die temperature", "celsius",
                        ("hw.temperature", gpu, "")),
            ]),
        ])


def training_dashboard() -> DashboardSpec:
    scope = Scope((("service.name", JOB_VAR), ("seedance.rank", RANK_VAR)))
    step = "seedance.train.step.duration"
    wait = "seedance.train.data_wait.duration"
    rank = ("service.name", "rank", "seedance.rank")
    group = (*rank, "seedance.module_group")
    comm = (*rank, "seedance.comm.backend")
    job = ("service.name",)
    allreduce = "seedance.comm.allreduce.duration"
    return DashboardSpec(
        uid="seedance-training", title="seedance / Training",
        description="What the torch training instrumentation measures, per job and rank",
        variables=(
            _job_variable(step),
            Variable(name=RANK_VAR, label="Rank", multi=True, query=_label_values(
                step, "seedance.rank", Scope((("service.name", JOB_VAR),))))),
        rows=[
            ("Throughput", [
                _quantiles(scope, "Step time", "Optimizer step wall time, p50 and p99 over "
                           "the selected ranks", step, job),
                PanelSpec(title="Tokens per second", description="Summed over the selected "
                          "ranks", unit="none", queries=(Query(
                              expr=by("seedance.train.tokens_per_second", job, "sum",
                                      scope.gauge("seedance.train.tokens_per_second")),
                              legend=legend("seedance.train.tokens_per_second", *job)),)),
                PanelSpec(title="Data wait share", unit="percentunit",
                          description="Share of wall time spent waiting for the next batch "
                          "(seconds waited per second), mean over the selected ranks",
                          queries=(Query(expr=by(wait, job, "avg", scope.seconds_per_second(
                              wait)), legend=legend(wait, *job)),)),
            ]),
            ("Optimisation", [
                _gauges(scope, "Loss", "Training loss of the last step", "none",
                        ("seedance.train.loss", rank, "")),
                _gauges(scope, "Learning rate", "Learning rate of the first param group",
                        "none", ("seedance.train.learning_rate", rank, "")),
                _gauges(scope, "Grad-scaler scale", "GradScaler loss scale", "none",
                        ("seedance.train.grad_scaler.scale", rank, "")),
            ]),
            ("Gradients", [
                _gauges(scope, "Gradient norm", "Global L2 norm of the gradients (unscaled)",
                        "none", ("seedance.train.grad.norm", rank, "")),
                _gauges(scope, "Gradient norm per module group", "L2 norm of each module "
                        "group's gradients", "none", ("seedance.train.grad.group_norm", group,
                                                      "")),
                _gauges(scope, "Zero fraction", "Fraction of gradient elements exactly zero",
                        "percentunit", ("seedance.train.grad.zero_fraction", group, "")),
                _gauges(scope, "Non-finite gradient elements", "NaN or infinite elements",
                        "none", ("seedance.train.grad.nonfinite", group, "")),
            ]),
            ("Communication", [
                _gauges(scope, "All-reduce bus bandwidth", "Per bucket of the last completed "
                        "step (nccl-tests busbw)", "Bps",
                        ("seedance.comm.allreduce.busbw", (*comm, "seedance.comm.bucket"), "")),
                _gauges(scope, "All-reduce algorithm bandwidth", "Per bucket of the last "
                        "completed step: bytes / latency", "Bps",
                        ("seedance.comm.allreduce.algbw", (*comm, "seedance.comm.bucket"), "")),
                _gauges(scope, "Bytes per step", "Bytes all-reduced in the last completed "
                        "step", "bytes", ("seedance.comm.step_bytes", comm, "")),
                PanelSpec(title="All-reduce calls and bytes", unit="none",
                          description="All-reduce calls per second and bytes per second",
                          queries=(
                              Query(expr=scope.rate("seedance.comm.allreduce.calls"),
                                    legend=legend("seedance.comm.allreduce.calls", *comm,
                                                  "calls/s")),
                              Query(expr=scope.rate("seedance.comm.allreduce.bytes"),
                                    legend=legend("seedance.comm.allreduce.bytes", *comm,
                                                  "bytes/s")))),
                _quantiles(scope, "All-reduce latency", "One bucket's all-reduce, launch to "
                           "completion", allreduce, ("service.name", "seedance.comm.backend")),
            ]),
        ])


def serving_dashboard() -> DashboardSpec:
    scope = Scope((("service.name", JOB_VAR),))
    job = ("service.name",)
    hits, queries = "seedance.serve.prefix_cache.hits", "seedance.serve.prefix_cache.queries"
    quant, dequant = "seedance.serve.kv.quantize.duration", "seedance.serve.kv.dequantize.duration"
    return DashboardSpec(
        uid="seedance-serving", title="seedance / Serving",
        description="What the serving instrumentation (or a scraped vLLM) measures, per job",
        variables=(_job_variable("gen_ai.server.request.duration"),),
        rows=[
            ("Latency", [
                _quantiles(scope, "Time to first token", "p50 and p99",
                           "gen_ai.server.time_to_first_token", job, span=8),
                _quantiles(scope, "Time per output token", "p50 and p99",
                           "gen_ai.server.time_per_output_token", job, span=8),
                _quantiles(scope, "End-to-end latency", "p50 and p99",
                           "gen_ai.server.request.duration", job, span=8),
            ]),
            ("Load", [
                PanelSpec(title="Output tokens per second", unit="none", span=8,
                          description="Sliding window, summed over the job's processes",
                          queries=(Query(
                              expr=by("seedance.serve.tokens_per_second", job, "sum",
                                      scope.gauge("seedance.serve.tokens_per_second")),
                              legend=legend("seedance.serve.tokens_per_second", *job)),)),
                _gauges(scope, "Batch size", "Requests in the decode batch", "none",
                        ("seedance.serve.batch_size", job, ""), span=8),
                _gauges(scope, "Queue depth", "Requests waiting", "none",
                        ("seedance.serve.queue_depth", job, ""), span=8),
            ]),
            ("KV cache", [
                _gauges(scope, "KV-cache bytes", "Bytes the KV cache holds", "bytes",
                        ("seedance.serve.kv_cache.bytes", job, ""), span=8),
                _gauges(scope, "KV-cache bits", "Bit-width in force (16 = unquantised)", "none",
                        ("seedance.serve.kv_cache.bits", (*job, "seedance.kv.part"), ""),
                        span=8),
                PanelSpec(title="Quantise / dequantise time", unit="percentunit", span=8,
                          description="Share of wall time spent (seconds per second)",
                          queries=tuple(
                              Query(expr=by(name, job, "sum", scope.seconds_per_second(name)),
                                    legend=legend(name, *job, word))
                              for name, word in ((quant, "quantise"), (dequant, "dequantise")))),
                PanelSpec(title="Prefix-cache hit rate", unit="percentunit", span=24,
                          description="Hits / look-ups over the rate window",
                          queries=(Query(
                              expr=f"{by(hits, job, 'sum', scope.rate(hits))} / "
                              f"{by(queries, job, 'sum', scope.rate(queries))}",
                              legend=legend(hits, *job)),)),
            ]),
        ])


def tuning_dashboard() -> DashboardSpec:
    scope = Scope((("service.name", JOB_VAR),))
    trials, changes = "seedance.tuning.trials", "seedance.tuning.changes"
    rollbacks = "seedance.tuning.rollbacks"
    objective = "seedance.tuning.objective"
    job = ("service.name",)

    def in_range(name: str, attrs: tuple[str, ...], title: str, description: str,
                 span: int = 8) -> PanelSpec:
        return PanelSpec(title=title, description=description, unit="none", kind="stat",
                         span=span, queries=(Query(
                             expr=by(name, attrs, "sum", scope.increase(name)),
                             legend=legend(name, *attrs)),))

    return DashboardSpec(
        uid="seedance-tuning", title="seedance / Tuning",
        description="Search trials, changes through their states, rollbacks and the objective",
        variables=(_job_variable(changes),),
        rows=[
            ("In the time range", [
                in_range(trials, ("state",), "Trials by state", "Trials that reached each "
                         "state in the dashboard's time range"),
                in_range(changes, ("state",), "Changes by state", "Changes that entered each "
                         "state in the dashboard's time range"),
                in_range(rollbacks, ("scope", "cause"), "Rollbacks", "By scope and cause in "
                         "the dashboard's time range"),
            ]),
            ("Over time", [
                PanelSpec(title="Changes entering each state", unit="none",
                          description="Per hour", queries=(Query(
                              expr=f"{by(changes, (*job, 'state'), 'sum', scope.rate(changes))}"
                              " * 3600", legend=legend(changes, *job, "state")),)),
                _gauges(scope, "Objective", "Objective value the last completed trial "
                        "measured", "none",
                        (objective, (*job, "v", "seedance.config.version"), "")),
            ]),
        ])


def findings_dashboard() -> DashboardSpec:
    scope = Scope((("service.name", JOB_VAR),))
    active = "seedance.findings.active"
    return DashboardSpec(
        uid="seedance-findings", title="seedance / Findings",
        description="Findings the policy engine holds open, per detector",
        variables=(_job_variable(active),),
        rows=[
            ("Open findings", [
                PanelSpec(title="Open findings", description="All detectors", unit="none",
                          kind="stat", span=6, queries=(Query(
                              expr=f"sum({scope.gauge(active)})", legend="open"),)),
                PanelSpec(title="Open findings by detector", description="Per detector",
                          unit="none", span=18, queries=(Query(
                              expr=by(active, ("service.name", "detector"), "sum",
                                      scope.gauge(active)),
                              legend=legend(active, "service.name", "detector")),)),
            ]),
        ])


DASHBOARDS: tuple[Callable[[], DashboardSpec], ...] = (
    gpu_dashboard, training_dashboard, serving_dashboard, tuning_dashboard, findings_dashboard)
