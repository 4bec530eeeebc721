"""The five Grafana dashboards: GPUs, training, serving, tuning, findings.

Every expression is written from catalogue names through :func:`collectors.prom_metric`; no
Prometheus series or label name is spelled here. ``$job`` filters every panel on the attribute
that names each metric's job (:data:`dashboards.grafana._model.JOB`), and every dashboard marks
the job's kept changes and rollbacks.
"""

from __future__ import annotations

from collections.abc import Callable

from collectors import prom_metric
from collectors.names import (
    ATTR_GPU_INDEX,
    ATTR_HOST_NAME,
    ATTR_NETWORK_IO_DIRECTION,
    ATTR_SEEDANCE_COMM_BACKEND,
    ATTR_SEEDANCE_COMM_BUCKET,
    ATTR_SEEDANCE_KV_PART,
    ATTR_SEEDANCE_MODULE_GROUP,
    ATTR_SEEDANCE_RANK,
    ATTR_SEEDANCE_SOURCE,
    ATTR_STATE,
    COMM_ALLREDUCE_ALGBW,
    COMM_ALLREDUCE_BUSBW,
    COMM_ALLREDUCE_BYTES,
    COMM_ALLREDUCE_CALLS,
    COMM_ALLREDUCE_DURATION,
    COMM_STEP_BYTES,
    FINDINGS_ACTIVE,
    GEN_AI_SERVER_REQUEST_DURATION,
    GEN_AI_SERVER_TIME_PER_OUTPUT_TOKEN,
    GEN_AI_SERVER_TIME_TO_FIRST_TOKEN,
    GPU_CLOCK,
    GPU_CLOCK_MAX,
    GPU_NVLINK_THROUGHPUT,
    GPU_PCIE_LINK_PEAK_BANDWIDTH,
    GPU_POWER_LIMIT,
    GPU_THROTTLE_REASONS,
    HW_GPU_IO,
    HW_GPU_MEMORY_LIMIT,
    HW_GPU_MEMORY_USAGE,
    HW_GPU_MEMORY_UTILIZATION,
    HW_GPU_UP,
    HW_GPU_UTILIZATION,
    HW_POWER,
    HW_TEMPERATURE,
    SERVE_BATCH_SIZE,
    SERVE_KV_CACHE_BITS,
    SERVE_KV_CACHE_BYTES,
    SERVE_KV_DEQUANTIZE_DURATION,
    SERVE_KV_QUANTIZE_DURATION,
    SERVE_PREFIX_CACHE_HITS,
    SERVE_PREFIX_CACHE_QUERIES,
    SERVE_QUEUE_DEPTH,
    SERVE_TOKENS_PER_SECOND,
    TRAIN_DATA_WAIT_DURATION,
    TRAIN_GRAD_GROUP_NORM,
    TRAIN_GRAD_NONFINITE,
    TRAIN_GRAD_NORM,
    TRAIN_GRAD_SCALER_SCALE,
    TRAIN_GRAD_ZERO_FRACTION,
    TRAIN_LEARNING_RATE,
    TRAIN_LOSS,
    TRAIN_STEP_DURATION,
    TRAIN_TOKENS_PER_SECOND,
    TUNING_CHANGES,
    TUNING_OBJECTIVE,
    TUNING_ROLLBACKS,
    TUNING_TRIALS,
)
from dashboards.grafana._model import (
    JOB,
    Annotation,
    DashboardSpec,
    PanelSpec,
    Query,
    Scope,
    Variable,
    by,
    labels_of,
    legend,
)

JOB_VAR = "job"
TOKENS_PER_S = "suffix: tokens/s"
LOSS = "suffix: nats"
NORM = "suffix: L2"
"""Grafana custom units: the axis says what the number is, where no built-in unit does."""
GPU_VAR = "gpu"
RANK_VAR = "rank"


def _label_values(name: str, attribute: str, scope: Scope | None = None) -> str:
    """A variable query listing the values of ``attribute`` on metric ``name``."""
    metric = prom_metric(name)
    series = scope.series(metric, metric.series) if scope else metric.series
    (label,) = labels_of(name, (attribute,))
    return f"label_values({series}, {label})"


def _job_variable(name: str) -> Variable:
    return Variable(name=JOB_VAR, label="Job", query=_label_values(name, JOB),
                    multi=True)


def _change_annotations() -> tuple[Annotation, ...]:
    """A marker where a change of a selected job was kept, and where one was rolled back."""
    changes = TUNING_CHANGES
    scope = Scope(((JOB, JOB_VAR),))
    metric = prom_metric(changes)
    state = metric.label(ATTR_STATE)

    def entered(to: str) -> str:
        selector = scope.series(metric, metric.total, f'{state}="{to}"')
        return f"{by(changes, (JOB,), 'sum', f'increase({selector}[$__interval])')} > 0"
    return (Annotation(name="Changes kept", expr=entered("kept"), color="green"),
            Annotation(name="Rollbacks", expr=entered("rolled_back"), color="red"))


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
    scope = Scope(((JOB, JOB_VAR), (ATTR_GPU_INDEX, GPU_VAR)))
    gpu = (ATTR_HOST_NAME, "GPU", ATTR_GPU_INDEX)
    up = HW_GPU_UP
    throttle = GPU_THROTTLE_REASONS
    throttle_by = (JOB, ATTR_HOST_NAME, ATTR_GPU_INDEX)
    reason = prom_metric(throttle).label("reason")
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
                     query=_label_values(up, ATTR_GPU_INDEX, Scope(((JOB, JOB_VAR),))),
                     multi=True)),
        annotations=_change_annotations(),
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
                        (HW_GPU_UTILIZATION, gpu, "")),
                _gauges(scope, "Memory-bandwidth utilisation",
                        "Fraction of time device memory was read or written", "percentunit",
                        (HW_GPU_MEMORY_UTILIZATION, gpu, "")),
                _gauges(scope, "Memory used", "Device memory in use and in total", "bytes",
                        (HW_GPU_MEMORY_USAGE, gpu, "used"),
                        (HW_GPU_MEMORY_LIMIT, gpu, "total")),
            ]),
            ("Interconnect", [
                _gauges(scope, "PCIe throughput", "PCIe throughput per direction and the "
                        "current link's one-direction peak", "Bps",
                        (HW_GPU_IO, (*gpu, ATTR_NETWORK_IO_DIRECTION), ""),
                        (GPU_PCIE_LINK_PEAK_BANDWIDTH, gpu, "peak")),
                _gauges(scope, "NVLink throughput", "Summed over links, where supported",
                        "Bps", (GPU_NVLINK_THROUGHPUT,
                                (*gpu, ATTR_NETWORK_IO_DIRECTION), "")),
            ]),
            ("Power, clocks, temperature", [
                _gauges(scope, "Power", "Board power draw and enforced limit", "watt",
                        (HW_POWER, gpu, "draw"), (GPU_POWER_LIMIT, gpu, "limit")),
                _gauges(scope, "Clocks", "Current and maximum clocks", "suffix: MHz",
                        (GPU_CLOCK, (*gpu, "clock"), ""),
                        (GPU_CLOCK_MAX, (*gpu, "clock"), "max")),
                _gauges(scope, "Temperature", "GPU die temperature", "celsius",
                        (HW_TEMPERATURE, gpu, "")),
            ]),
        ])


def training_dashboard() -> DashboardSpec:
    scope = Scope(((JOB, JOB_VAR), (ATTR_SEEDANCE_RANK, RANK_VAR)))
    step = TRAIN_STEP_DURATION
    wait = TRAIN_DATA_WAIT_DURATION
    rank = (JOB, "rank", ATTR_SEEDANCE_RANK)
    group = (*rank, ATTR_SEEDANCE_MODULE_GROUP)
    comm = (*rank, ATTR_SEEDANCE_COMM_BACKEND)
    job = (JOB,)
    allreduce = COMM_ALLREDUCE_DURATION
    return DashboardSpec(
        uid="seedance-training", title="seedance / Training",
        description="What the torch training instrumentation measures, per job and rank",
        variables=(
            _job_variable(step),
            Variable(name=RANK_VAR, label="Rank", multi=True, query=_label_values(
                step, ATTR_SEEDANCE_RANK, Scope(((JOB, JOB_VAR),))))),
        annotations=_change_annotations(),
        rows=[
            ("Throughput", [
                _quantiles(scope, "Step time", "Optimizer step wall time, p50 and p99 over "
                           "the selected ranks", step, job),
                PanelSpec(title="Tokens per second", description="Summed over the selected "
                          "ranks", unit=TOKENS_PER_S, queries=(Query(
                              expr=by(TRAIN_TOKENS_PER_SECOND, job, "sum",
                                      scope.gauge(TRAIN_TOKENS_PER_SECOND)),
                              legend=legend(TRAIN_TOKENS_PER_SECOND, *job)),)),
                PanelSpec(title="Data wait share", unit="percentunit",
                          description="Share of wall time spent waiting for the next batch "
                          "(seconds waited per second), mean over the selected ranks",
                          queries=(Query(expr=by(wait, job, "avg", scope.seconds_per_second(
                              wait)), legend=legend(wait, *job)),)),
            ]),
            ("Optimisation", [
                _gauges(scope, "Loss", "Training loss of the last step (cross-entropy in nats "
                        "for a language model)", LOSS,
                        (TRAIN_LOSS, rank, "")),
                _gauges(scope, "Learning rate", "Learning rate of the first param group",
                        "none", (TRAIN_LEARNING_RATE, rank, "")),
                _gauges(scope, "Grad-scaler scale", "GradScaler loss scale", "none",
                        (TRAIN_GRAD_SCALER_SCALE, rank, "")),
            ]),
            ("Gradients", [
                _gauges(scope, "Gradient norm", "Global L2 norm of the gradients (unscaled)",
                        NORM, (TRAIN_GRAD_NORM, rank, "")),
                _gauges(scope, "Gradient norm per module group", "L2 norm of each module "
                        "group's gradients", NORM, (TRAIN_GRAD_GROUP_NORM, group,
                                                      "")),
                _gauges(scope, "Zero fraction", "Fraction of gradient elements exactly zero",
                        "percentunit", (TRAIN_GRAD_ZERO_FRACTION, group, "")),
                _gauges(scope, "Non-finite gradient elements", "NaN or infinite elements",
                        "none", (TRAIN_GRAD_NONFINITE, group, "")),
            ]),
            ("Communication", [
                _gauges(scope, "All-reduce bus bandwidth", "Per bucket of the last completed "
                        "step (nccl-tests busbw)", "Bps",
                        (COMM_ALLREDUCE_BUSBW, (*comm, ATTR_SEEDANCE_COMM_BUCKET), "")),
                _gauges(scope, "All-reduce algorithm bandwidth", "Per bucket of the last "
                        "completed step: bytes / latency", "Bps",
                        (COMM_ALLREDUCE_ALGBW, (*comm, ATTR_SEEDANCE_COMM_BUCKET), "")),
                _gauges(scope, "Bytes per step", "Bytes all-reduced in the last completed "
                        "step", "bytes", (COMM_STEP_BYTES, comm, "")),
                PanelSpec(title="All-reduce calls and bytes", unit="none",
                          description="All-reduce calls per second and bytes per second",
                          queries=(
                              Query(expr=scope.rate(COMM_ALLREDUCE_CALLS),
                                    legend=legend(COMM_ALLREDUCE_CALLS, *comm,
                                                  "calls/s")),
                              Query(expr=scope.rate(COMM_ALLREDUCE_BYTES),
                                    legend=legend(COMM_ALLREDUCE_BYTES, *comm,
                                                  "bytes/s")))),
                _quantiles(scope, "All-reduce latency", "One bucket's all-reduce, launch to "
                           "completion", allreduce, (JOB, ATTR_SEEDANCE_COMM_BACKEND)),
            ]),
        ])


def serving_dashboard() -> DashboardSpec:
    scope = Scope(((JOB, JOB_VAR),))
    job = (JOB,)
    hits, queries = SERVE_PREFIX_CACHE_HITS, SERVE_PREFIX_CACHE_QUERIES
    quant, dequant = SERVE_KV_QUANTIZE_DURATION, SERVE_KV_DEQUANTIZE_DURATION
    return DashboardSpec(
        uid="seedance-serving", title="seedance / Serving",
        description="What the serving instrumentation (or a scraped vLLM) measures, per job",
        variables=(_job_variable(GEN_AI_SERVER_REQUEST_DURATION),),
        annotations=_change_annotations(),
        rows=[
            ("Latency", [
                _quantiles(scope, "Time to first token", "p50 and p99",
                           GEN_AI_SERVER_TIME_TO_FIRST_TOKEN, job, span=8),
                _quantiles(scope, "Time per output token", "p50 and p99",
                           GEN_AI_SERVER_TIME_PER_OUTPUT_TOKEN, job, span=8),
                _quantiles(scope, "End-to-end latency", "p50 and p99",
                           GEN_AI_SERVER_REQUEST_DURATION, job, span=8),
            ]),
            ("Load", [
                PanelSpec(title="Output tokens per second", unit=TOKENS_PER_S, span=8,
                          description="Sliding window, summed over the job's processes",
                          queries=(Query(
                              expr=by(SERVE_TOKENS_PER_SECOND, job, "sum",
                                      scope.gauge(SERVE_TOKENS_PER_SECOND)),
                              legend=legend(SERVE_TOKENS_PER_SECOND, *job)),)),
                _gauges(scope, "Batch size", "Requests in the decode batch", "none",
                        (SERVE_BATCH_SIZE, job, ""), span=8),
                _gauges(scope, "Queue depth", "Requests waiting", "none",
                        (SERVE_QUEUE_DEPTH, job, ""), span=8),
            ]),
            ("KV cache", [
                _gauges(scope, "KV-cache bytes", "Bytes the KV cache holds", "bytes",
                        (SERVE_KV_CACHE_BYTES, job, ""), span=8),
                _gauges(scope, "KV-cache bits", "Bit-width in force (16 = unquantised)", "none",
                        (SERVE_KV_CACHE_BITS, (*job, ATTR_SEEDANCE_KV_PART), ""),
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
    scope = Scope(((JOB, JOB_VAR),))
    trials, changes = TUNING_TRIALS, TUNING_CHANGES
    rollbacks = TUNING_ROLLBACKS
    objective = TUNING_OBJECTIVE
    job = (JOB,)
    entering = (*job, ATTR_STATE, ATTR_SEEDANCE_SOURCE)

    def in_range(name: str, attrs: tuple[str, ...], title: str, description: str,
                 span: int = 8) -> PanelSpec:
        return PanelSpec(title=title, description=description, unit="none", kind="stat",
                         span=span, queries=(Query(
                             expr=by(name, attrs, "sum", scope.increase(name)),
                             legend=legend(name, *attrs)),))

    return DashboardSpec(
        uid="seedance-tuning", title="seedance / Tuning",
        description="Search trials, changes through their states, rollbacks and the gain "
        "each judged change measured",
        variables=(_job_variable(changes),),
        annotations=_change_annotations(),
        rows=[
            ("In the time range", [
                in_range(trials, (ATTR_STATE,), "Trials by state", "Changes the search "
                         "proposed that ended in the dashboard's time range, by their end"),
                in_range(changes, (ATTR_STATE,), "Changes by state", "Changes that entered "
                         "each state in the dashboard's time range"),
                in_range(rollbacks, ("scope", "cause"), "Rollbacks", "By scope and cause in "
                         "the dashboard's time range"),
            ]),
            ("Over time", [
                PanelSpec(title="Changes entering each state", unit="none",
                          description="Per hour, by who proposed them", queries=(Query(
                              expr=f"{by(changes, entering, 'sum', scope.rate(changes))}"
                              " * 3600", legend=legend(changes, *entering)),)),
                _gauges(scope, "Gain of the last judged change", "Relative tokens/s gain "
                        "(candidate over baseline, minus 1) the job's last judged change "
                        "measured, by the state it was judged into", "percentunit",
                        (objective, (*job, ATTR_STATE), "")),
            ]),
        ])


def findings_dashboard() -> DashboardSpec:
    scope = Scope(((JOB, JOB_VAR),))
    active = FINDINGS_ACTIVE
    return DashboardSpec(
        uid="seedance-findings", title="seedance / Findings",
        description="Findings the policy engine holds open, per detector",
        variables=(_job_variable(active),),
        annotations=_change_annotations(),
        rows=[
            ("Open findings", [
                PanelSpec(title="Open findings", description="All detectors", unit="none",
                          kind="stat", span=6, queries=(Query(
                              expr=f"sum({scope.gauge(active)})", legend="open"),)),
                PanelSpec(title="Open findings by detector", description="Per detector",
                          unit="none", span=18, queries=(Query(
                              expr=by(active, (JOB, "detector"), "sum",
                                      scope.gauge(active)),
                              legend=legend(active, JOB, "detector")),)),
            ]),
        ])


DASHBOARDS: tuple[Callable[[], DashboardSpec], ...] = (
    gpu_dashboard, training_dashboard, serving_dashboard, tuning_dashboard, findings_dashboard)
