"""The metric catalogue: every name the project emits, with unit, source and attributes.

One list that code, docs/metrics.md (generated: ``python -m collectors.catalogue``) and the
Grafana generator read, so a name is spelled once. OpenTelemetry semantic conventions are used
where one exists (``hw.gpu.*``, ``hw.*``, ``gen_ai.*``); everything else is ``seedance.*``.
"""

from __future__ import annotations

from dataclasses import dataclass

from collectors._points import MetricKind


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricSpec:
    """One catalogue entry (unit in UCUM, as OpenTelemetry writes it)."""

    name: str
    unit: str
    kind: MetricKind
    source: str
    description: str
    attributes: tuple[str, ...] = ()


G, S, H = MetricKind.GAUGE, MetricKind.SUM, MetricKind.HISTOGRAM
_SIDECAR_JOB = "seedance.job"
"""What the sidecar's own series say about a job carry the job's name here (Prometheus
``seedance_job``), apart from their ``service.name`` (the sidecar's) and from Prometheus's
own ``job`` target label."""
_GPU = ("hw.id", "hw.name", "gpu.index", "gpu.pci_address", "host.name", _SIDECAR_JOB)
"""``seedance.job``: the one job attached to the sidecar, while exactly one is."""
_JOB = ("service.name", "host.name", "seedance.rank", "seedance.config.version")

GPU_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(name="hw.gpu.up", unit="1", kind=G, source="nvml", attributes=_GPU,
               description="1 while the GPU answers NVML, 0 once it is lost"),
    MetricSpec(name="hw.gpu.utilization", unit="1", kind=G, source="nvml",
               attributes=_GPU + ("hw.gpu.task",),
               description="Fraction of time a kernel ran (nvmlDeviceGetUtilizationRates.gpu)"),
    MetricSpec(name="hw.gpu.memory.utilization", unit="1", kind=G, source="nvml",
               attributes=_GPU,
               description="Fraction of time device memory was read or written "
               "(nvmlDeviceGetUtilizationRates.memory)"),
    MetricSpec(name="hw.gpu.memory.usage", unit="By", kind=G, source="nvml", attributes=_GPU,
               description="Device memory in use"),
    MetricSpec(name="hw.gpu.memory.limit", unit="By", kind=G, source="nvml", attributes=_GPU,
               description="Device memory in total"),
    MetricSpec(name="hw.gpu.io", unit="By/s", kind=G, source="nvml",
               attributes=_GPU + ("network.io.direction",),
               description="PCIe throughput, direction transmit|receive "
               "(nvmlDeviceGetPcieThroughput)"),
    MetricSpec(name="seedance.gpu.pcie.link.generation", unit="1", kind=G, source="nvml",
               attributes=_GPU + ("state",),
               description="PCIe link generation, state current|max"),
    MetricSpec(name="seedance.gpu.pcie.link.width", unit="{lane}", kind=G, source="nvml",
               attributes=_GPU + ("state",),
               description="PCIe link width in lanes, state current|max"),
    MetricSpec(name="seedance.gpu.pcie.link.peak_bandwidth", unit="By/s", kind=G,
               source="nvml (derived)", attributes=_GPU,
               description="Peak one-direction PCIe bandwidth of the current link "
               "(generation x width)"),
    MetricSpec(name="seedance.gpu.nvlink.throughput", unit="By/s", kind=G, source="nvml",
               attributes=_GPU + ("network.io.direction",),
               description="NVLink throughput summed over links, where supported"),
    MetricSpec(name="hw.power", unit="W", kind=G, source="nvml", attributes=_GPU,
               description="Board power draw"),
    MetricSpec(name="seedance.gpu.power.limit", unit="W", kind=G, source="nvml",
               attributes=_GPU, description="Enforced power limit"),
    MetricSpec(name="seedance.gpu.clock", unit="MHz", kind=G, source="nvml",
               attributes=_GPU + ("clock",),
               description="Current clock, clock sm|memory|graphics"),
    MetricSpec(name="seedance.gpu.clock.max", unit="MHz", kind=G, source="nvml",
               attributes=_GPU + ("clock",), description="Maximum clock, clock sm|memory"),
    MetricSpec(name="seedance.gpu.memory.bus_width", unit="bit", kind=G, source="nvml",
               attributes=_GPU, description="Memory bus width"),
    MetricSpec(name="seedance.gpu.memory.peak_bandwidth", unit="By/s", kind=G,
               source="nvml (derived)", attributes=_GPU,
               description="Peak memory bandwidth: bus width x max memory clock x 2 (DDR)"),
    MetricSpec(name="hw.temperature", unit="Cel", kind=G, source="nvml", attributes=_GPU,
               description="GPU die temperature"),
    MetricSpec(name="seedance.gpu.throttle_reasons", unit="1", kind=G, source="nvml",
               attributes=_GPU + ("reason",),
               description="1 while the named clock-throttle reason is active"),
    MetricSpec(name="hw.errors", unit="{error}", kind=S, source="nvml",
               attributes=_GPU + ("error.type",),
               description="ECC errors (error.type ecc_corrected|ecc_uncorrected) and XID events "
               "(error.type xid)"),
    MetricSpec(name="seedance.gpu.info", unit="1", kind=G, source="nvml",
               attributes=_GPU + ("hw.gpu.uuid", "numa.node"),
               description="Always 1; carries the GPU's identity as attributes"),
)

TRAINING_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(name="seedance.train.step.duration", unit="s", kind=H, source="torch client",
               attributes=_JOB, description="Wall time of one optimizer step"),
    MetricSpec(name="seedance.train.data_wait.duration", unit="s", kind=H,
               source="torch client", attributes=_JOB,
               description="Time the step waited for its next batch"),
    MetricSpec(name="seedance.train.tokens_per_second", unit="{token}/s", kind=G,
               source="torch client", attributes=_JOB,
               description="Tokens per second over the step and the data wait before it"),
    MetricSpec(name="seedance.train.tokens", unit="{token}", kind=S, source="torch client",
               attributes=_JOB,
               description="Tokens the job's steps processed (cumulative, per config version); "
               "over the step-duration sum of the same version it is exact tokens/s"),
    MetricSpec(name="seedance.train.samples_per_second", unit="{sample}/s", kind=G,
               source="torch client", attributes=_JOB,
               description="Samples per second over the step and the data wait before it"),
    MetricSpec(name="seedance.train.loss", unit="1", kind=G, source="torch client",
               attributes=_JOB, description="Training loss of the last step"),
    MetricSpec(name="seedance.train.step_loss", unit="1", kind=H, source="torch client",
               attributes=_JOB, description="Training loss of every step with a finite one, "
               "as a histogram with no bucket bounds: its sum over its count is the mean loss "
               "of a window's steps (the loss gauge holds one step's at each export)"),
    MetricSpec(name="seedance.train.step", unit="{step}", kind=G, source="torch client",
               attributes=_JOB, description="Index of the last completed step"),
    MetricSpec(name="seedance.train.grad.norm", unit="1", kind=G, source="torch client",
               attributes=_JOB, description="Global L2 norm of the gradients (unscaled), read about once per "
               "grad_interval_s of the job's time (a session: the export interval)"),
    MetricSpec(name="seedance.train.grad.group_norm", unit="1", kind=G, source="torch client",
               attributes=_JOB + ("seedance.module_group",),
               description="L2 norm of one module group's gradients (read with the global norm)"),
    MetricSpec(name="seedance.train.grad.nonfinite", unit="{element}", kind=G,
               source="torch client", attributes=_JOB + ("seedance.module_group",),
               description="Gradient elements that are NaN or infinite (every stats_every-th "
               "gradient reading)"),
    MetricSpec(name="seedance.train.nonfinite_steps", unit="{step}", kind=S,
               source="torch client", attributes=_JOB + ("seedance.nonfinite.what",),
               description="Steps whose loss (what=loss, every step) or global gradient norm "
               "(what=grad_norm, steps whose gradients were read) was NaN or infinite; OpenTelemetry drops non-finite gauge "
               "values, so this counter is what carries the signal"),
    MetricSpec(name="seedance.train.grad.zero_fraction", unit="1", kind=G,
               source="torch client", attributes=_JOB + ("seedance.module_group",),
               description="Fraction of gradient elements that are exactly zero (every "
               "stats_every-th gradient reading)"),
    MetricSpec(name="seedance.train.grad_scaler.scale", unit="1", kind=G,
               source="torch client", attributes=_JOB,
               description="GradScaler loss scale in force when the gradients were read"),
    MetricSpec(name="seedance.train.learning_rate", unit="1", kind=G, source="torch client",
               attributes=_JOB, description="Learning rate of the first param group"),
)

_GROUP = _JOB + ("seedance.module_group",)

PROFILE_METRICS: tuple[MetricSpec, ...] = (
    # collectors/torch_profile.py: set on sampled steps only (every every_n_steps and the first).
    MetricSpec(name="seedance.train.group.time_share", unit="1", kind=G,
               source="torch profiler", attributes=_GROUP,
               description="Share of the forward time spent in one module group's modules "
               "(modules of other groups nested in them excluded), on a sampled step"),
    MetricSpec(name="seedance.train.group.forward_rank", unit="1", kind=G,
               source="torch profiler", attributes=_GROUP,
               description="Position of the group in the forward (0 = its modules run first)"),
    MetricSpec(name="seedance.train.group.param_dtype", unit="1", kind=G,
               source="torch profiler",
               attributes=_GROUP + ("seedance.dtype", "seedance.dtype.source"),
               description="Always 1; one series per dtype the group computes in: source "
               "parameters (dtype of its floating parameters while its modules run, a "
               "compute-dtype copy under tuner.precision) or autocast (the autocast dtype in "
               "force when they run)"),
    MetricSpec(name="seedance.train.block.time_share", unit="1", kind=G,
               source="torch profiler", attributes=_JOB + ("seedance.block",),
               description="Share of the forward time spent in one repeated block (blocks.N, "
               "layers.N: numbered children of a ModuleList or Sequential), all groups "
               "included"),
    MetricSpec(name="seedance.device.matmul_speedup", unit="1", kind=G,
               source="torch profiler", attributes=_JOB + ("seedance.dtype", "hw.model"),
               description="Square-matmul speed in a dtype relative to float32 on the job's "
               "device, measured at attach (cached per device model); above 1 is faster"),
)

_COMM = _JOB + ("seedance.comm.backend",)
_COMM_BUCKET = _COMM + ("seedance.comm.bucket",)

COLLECTIVE_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(name="seedance.comm.allreduce.duration", unit="s", kind=H,
               source="DDP comm hook", attributes=_COMM,
               description="Latency of one bucket's all-reduce, launch to completion"),
    MetricSpec(name="seedance.comm.allreduce.bytes", unit="By", kind=S, source="DDP comm hook",
               attributes=_COMM,
               description="Bytes all-reduced (bucket buffer size)"),
    MetricSpec(name="seedance.comm.allreduce.calls", unit="{call}", kind=S,
               source="DDP comm hook", attributes=_COMM,
               description="All-reduce calls (one per bucket per step)"),
    MetricSpec(name="seedance.comm.allreduce.algbw", unit="By/s", kind=G,
               source="DDP comm hook", attributes=_COMM_BUCKET,
               description="Algorithm bandwidth of each bucket of the last completed step: "
               "bytes / latency"),
    MetricSpec(name="seedance.comm.allreduce.busbw", unit="By/s", kind=G,
               source="DDP comm hook", attributes=_COMM_BUCKET,
               description="Bus bandwidth (nccl-tests) of each bucket of the last completed "
               "step: algbw x 2(n-1)/n"),
    MetricSpec(name="seedance.comm.step_bytes", unit="By", kind=G, source="DDP comm hook",
               attributes=_COMM, description="Bytes all-reduced in the last completed step"),
)

SERVING_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(name="gen_ai.server.time_to_first_token", unit="s", kind=H,
               source="serving client", attributes=_JOB,
               description="Time to first token"),
    MetricSpec(name="gen_ai.server.time_per_output_token", unit="s", kind=H,
               source="serving client", attributes=_JOB,
               description="Per request: (end - first token) / (output tokens - 1)"),
    MetricSpec(name="gen_ai.server.request.duration", unit="s", kind=H,
               source="serving client", attributes=_JOB, description="End-to-end latency"),
    MetricSpec(name="seedance.serve.tokens_per_second", unit="{token}/s", kind=G,
               source="serving client", attributes=_JOB,
               description="Output tokens per second over a sliding window"),
    MetricSpec(name="seedance.serve.batch_size", unit="{request}", kind=G,
               source="serving client", attributes=_JOB,
               description="Requests in the decode batch"),
    MetricSpec(name="seedance.serve.queue_depth", unit="{request}", kind=G,
               source="serving client", attributes=_JOB, description="Requests waiting"),
    MetricSpec(name="seedance.serve.kv_cache.bytes", unit="By", kind=G,
               source="serving client", attributes=_JOB,
               description="Bytes the KV cache holds (measured from its tensors)"),
    MetricSpec(name="seedance.serve.kv_cache.bits", unit="bit", kind=G,
               source="serving client", attributes=_JOB + ("seedance.kv.part",),
               description="KV-cache bit-width in force (16 = unquantised)"),
    MetricSpec(name="seedance.serve.kv_cache.usage", unit="1", kind=G,
               source="serving client / vllm", attributes=_JOB,
               description="Fraction of the KV cache in use"),
    MetricSpec(name="seedance.serve.kv.quantize.duration", unit="s", kind=H,
               source="serving client", attributes=_JOB, description="Time spent quantising"),
    MetricSpec(name="seedance.serve.kv.dequantize.duration", unit="s", kind=H,
               source="serving client", attributes=_JOB, description="Time spent dequantising"),
    MetricSpec(name="seedance.serve.prefix_cache.hits", unit="{request}", kind=S,
               source="serving client / vllm", attributes=_JOB, description="Prefix-cache hits"),
    MetricSpec(name="seedance.serve.prefix_cache.queries", unit="{request}", kind=S,
               source="serving client / vllm", attributes=_JOB,
               description="Prefix-cache look-ups"),
    MetricSpec(name="seedance.serve.prefix_cache.misses", unit="{request}", kind=S,
               source="serving client", attributes=_JOB, description="Prefix-cache misses"),
    MetricSpec(name="seedance.serve.prefix_cache.evictions", unit="{entry}", kind=S,
               source="serving client", attributes=_JOB, description="Prefix-cache evictions"),
    MetricSpec(name="seedance.serve.prefix_cache.distinct_prefixes", unit="{prefix}", kind=G,
               source="serving client", attributes=_JOB,
               description="Distinct prefixes among the cache's recent look-ups (its history)"),
    MetricSpec(name="seedance.serve.preemptions", unit="{request}", kind=S, source="vllm",
               attributes=_JOB, description="Requests preempted"),
    MetricSpec(name="seedance.serve.quality.token_agreement", unit="1", kind=G,
               source="serving workload", attributes=_JOB,
               description="Share of sampled generated tokens that match a cache-free forward "
               "pass (quality guardrail)"),
    MetricSpec(name="seedance.serve.quality.checked_tokens", unit="{token}", kind=S,
               source="serving workload", attributes=_JOB,
               description="Generated tokens checked against a cache-free forward pass (the "
               "quality guardrail's sample size)"),
    MetricSpec(name="seedance.serve.quality.agreeing_tokens", unit="{token}", kind=S,
               source="serving workload", attributes=_JOB,
               description="Checked tokens that match the cache-free forward pass"),
    MetricSpec(name="seedance.serve.replicas", unit="{replica}", kind=G, source="serving job",
               attributes=_JOB, description="Serving replicas running"),
    MetricSpec(name="seedance.serve.cold_starts", unit="{replica}", kind=S, source="serving job",
               attributes=_JOB, description="Replicas started cold (weights and cache empty)"),
)

_DCGM = _GPU + ("seedance.source",)
_VLLM = ("service.name", "gen_ai.request.model", "seedance.vllm.engine", "seedance.source")

SCRAPE_METRICS: tuple[MetricSpec, ...] = (
    # Names only scrape sources produce; scraped series that match a name above (hw.power,
    # gen_ai.server.*, ...) reuse it. collectors/_scrape_rules.py holds the series -> name rules.
    MetricSpec(name="hw.energy", unit="J", kind=S, source="dcgm-exporter", attributes=_DCGM,
               description="Energy the GPU used since the driver loaded"),
    MetricSpec(name="seedance.gpu.memory.free", unit="By", kind=G, source="dcgm-exporter",
               attributes=_DCGM, description="Device memory free"),
    MetricSpec(name="seedance.gpu.memory.reserved", unit="By", kind=G, source="dcgm-exporter",
               attributes=_DCGM, description="Device memory the driver reserves"),
    MetricSpec(name="seedance.gpu.memory.temperature", unit="Cel", kind=G,
               source="dcgm-exporter", attributes=_DCGM, description="Memory temperature"),
    MetricSpec(name="seedance.gpu.xid.last", unit="1", kind=G, source="dcgm-exporter",
               attributes=_DCGM,
               description="Code of the last XID error (0: none); a code, not a count"),
    MetricSpec(name="seedance.gpu.pcie.replays", unit="{event}", kind=S,
               source="dcgm-exporter", attributes=_DCGM, description="PCIe link retries"),
    MetricSpec(name="seedance.gpu.nvlink.raw_bandwidth", unit="{raw}", kind=G,
               source="dcgm-exporter", attributes=_DCGM,
               description="DCGM field 449 as exported, not converted: its unit is not "
               "documented consistently (typed a counter, reported by some DCGM versions as "
               "MB/s); compare it only with itself"),
    MetricSpec(name="seedance.gpu.graphics_engine.active", unit="1", kind=G,
               source="dcgm-exporter", attributes=_DCGM,
               description="Fraction of time the graphics/compute engine was active"),
    MetricSpec(name="seedance.gpu.sm.active", unit="1", kind=G, source="dcgm-exporter",
               attributes=_DCGM,
               description="Fraction of cycles an SM had at least one warp assigned "
               "(averaged over SMs)"),
    MetricSpec(name="seedance.gpu.sm.occupancy", unit="1", kind=G, source="dcgm-exporter",
               attributes=_DCGM,
               description="Resident warps as a fraction of the SMs' maximum"),
    MetricSpec(name="seedance.gpu.pipe.active", unit="1", kind=G, source="dcgm-exporter",
               attributes=_DCGM + ("pipe",),
               description="Fraction of cycles a pipe was active, pipe tensor|fp64|fp32|fp16"),
    MetricSpec(name="seedance.gpu.dram.active", unit="1", kind=G, source="dcgm-exporter",
               attributes=_DCGM,
               description="Fraction of cycles the device memory interface sent or received "
               "data (a truer memory-bound signal than hw.gpu.memory.utilization)"),
    MetricSpec(name="seedance.serve.prefix_cache.hit_tokens", unit="{token}", kind=S,
               source="vllm", attributes=_VLLM,
               description="Prompt tokens found in the prefix cache (vLLM v1)"),
    MetricSpec(name="seedance.serve.prefix_cache.query_tokens", unit="{token}", kind=S,
               source="vllm", attributes=_VLLM,
               description="Prompt tokens looked up in the prefix cache (vLLM v1)"),
    MetricSpec(name="seedance.serve.prefix_cache.hit_ratio", unit="1", kind=G, source="vllm",
               attributes=_VLLM,
               description="Prefix-cache hit rate as vLLM v0 reports it"),
    MetricSpec(name="seedance.serve.prompt_tokens", unit="{token}", kind=S, source="vllm",
               attributes=_VLLM, description="Prompt (prefill) tokens processed"),
    MetricSpec(name="seedance.serve.generation_tokens", unit="{token}", kind=S, source="vllm",
               attributes=_VLLM, description="Tokens generated"),
)

POLICY_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(name="seedance.findings.active", unit="{finding}", kind=G,
               source="policy engine", attributes=("detector", "service.name", _SIDECAR_JOB),
               description="Findings open now, per detector and job (0 for a detector with "
               "none open on a job the engine judged in its last pass)"),
    MetricSpec(name="seedance.policy.errors", unit="{error}", kind=S,
               source="policy engine", attributes=("detector", "job", "stage", "service.name"),
               description="Evaluations that failed for one detector and job (stage evaluate: "
               "the detector raised; save: its findings could not be saved); the other "
               "detectors and jobs of the pass go on"),
)

TUNING_METRICS: tuple[MetricSpec, ...] = (
    # Emitted by the rollout controller in the sidecar; service.name is the sidecar's resource.
    MetricSpec(name="seedance.tuning.trials", unit="{trial}", kind=S,
               source="rollout controller",
               attributes=("service.name", _SIDECAR_JOB, "state"),
               description="Changes the search proposed (source trial) that ended, by the "
               "state they ended in (kept|rolled_back|rejected|expired|failed)"),
    MetricSpec(name="seedance.tuning.changes", unit="{change}", kind=S,
               source="rollout controller",
               attributes=("service.name", _SIDECAR_JOB, "state", "seedance.source"),
               description="Changes that entered a state (state proposed|approved|applying|"
               "observing|kept|rolled_back|rejected|expired|failed|manual_intervention_required"
               "), by who proposed them (seedance.source trial|finding|operator)"),
    MetricSpec(name="seedance.tuning.rollbacks", unit="{rollback}", kind=S,
               source="rollout controller",
               attributes=("service.name", _SIDECAR_JOB, "scope", "cause"),
               description="Rollbacks, scope full|local|config (the trip's kind), cause what "
               "forced it: guardrail|verdict|pruned|job_failed|timeout|operator|stopped|"
               "recovery"),
    MetricSpec(name="seedance.tuning.objective", unit="1", kind=G,
               source="rollout controller",
               attributes=("service.name", _SIDECAR_JOB, "state"),
               description="Relative tokens/s gain (candidate over baseline, minus 1) the "
               "last judged change of the job measured, state kept|rolled_back"),
)

HEALTH_METRICS: tuple[MetricSpec, ...] = (
    # seedancectl/_health.py: the sidecar's parts that can fail quietly.
    MetricSpec(name="seedance.scrape.up", unit="1", kind=G, source="sidecar",
               attributes=("service.name", "source"),
               description="1 when the last scrape of a source (its URL) worked, else 0"),
    MetricSpec(name="seedance.scrape.errors", unit="{scrape}", kind=S, source="sidecar",
               attributes=("service.name", "source"),
               description="Scrapes of a source that failed (down, timeout, garbage)"),
    MetricSpec(name="seedance.forward.failures", unit="{body}", kind=S, source="sidecar",
               attributes=("service.name", "signal", "outcome"),
               description="OTLP bodies the upstream did not take (outcome failed) or that "
               "never reached it (dropped: its queue was full), per signal"),
    MetricSpec(name="seedance.ingest.dropped_points", unit="{point}", kind=S,
               source="sidecar", attributes=("service.name", "limit"),
               description="Points of new series dropped by the cardinality limit (limit "
               "metric: max_series_per_metric, series of one metric from one job; job: "
               "max_series_per_job)"),
    MetricSpec(name="seedance.ingest.rejected_requests", unit="{request}", kind=S,
               source="sidecar", attributes=("service.name", "reason"),
               description="OTLP requests answered 4xx or 5xx (reason any), those without "
               "the ingest token (reason unauthorised) and those a job sent over its share of "
               "the store's buffer, answered 429 (reason throttled)"),
    MetricSpec(name="seedance.ingest.accepted_requests", unit="{request}", kind=S,
               source="sidecar", attributes=("service.name", "decoded_by"),
               description="OTLP requests answered 200 (decoded_by any) and the metric exports "
               "among them that repeat a shape seen before, handed on as columns with no Point "
               "per value (decoded_by template; protobuf ones also skip the protobuf walk)"),
    MetricSpec(name="http.server.request.duration", unit="s", kind=H, source="sidecar",
               attributes=("service.name", "http.request.method", "http.route",
                           "http.response.status_code"),
               description="Time the sidecar took to answer an HTTP request, from the request "
               "reaching its app to the last byte handed to the server, per route template: "
               "its own part of a client's latency (OpenTelemetry HTTP semantic conventions)"),
    MetricSpec(name="seedance.store.buffered_points", unit="{point}", kind=G,
               source="sidecar", attributes=("service.name",),
               description="Points waiting for the store's next commit (the backlog); past "
               "half the buffer, a job holding more than half of it gets 429 while "
               "another job's points wait too"),
    MetricSpec(name="seedance.store.writable", unit="1", kind=G, source="sidecar",
               attributes=("service.name",),
               description="1 when the store's last flush committed; 0 while it cannot "
               "(disk full, read-only): /readyz says why"),
    MetricSpec(name="cpython.gc.collections", unit="{collection}", kind=S, source="sidecar",
               attributes=("service.name", "cpython.gc.generation"),
               description="Collections of each generation by the sidecar's garbage collector "
               "(OpenTelemetry CPython runtime conventions): each one holds the interpreter "
               "lock, and a full one (generation 2) every 10-20 s was part of a fleet API's slow tail "
               "(docs/scale.md)"),
)

CATALOGUE: tuple[MetricSpec, ...] = (
    GPU_METRICS + TRAINING_METRICS + PROFILE_METRICS + COLLECTIVE_METRICS + SERVING_METRICS
    + SCRAPE_METRICS + POLICY_METRICS + TUNING_METRICS + HEALTH_METRICS
)
BY_NAME: dict[str, MetricSpec] = {spec.name: spec for spec in CATALOGUE}
