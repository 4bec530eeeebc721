"""Deciding what is wrong: cost models, detectors and the engine that runs them.

Importing this package never imports torch.
"""

from policies._communication_cost import (
    SplitCommunication,
    allreduce_calls,
    allreduce_time_s,
    microbatches_for_bubble,
    ring_allreduce_bytes_per_rank,
    split_communication,
)
from policies._detector import Detector, SelfCheck
from policies._engine import (
    ACTIVE_FINDINGS_METRIC,
    ERRORS_METRIC,
    FINDING_CLOSED_EVENT,
    FINDING_OPENED_EVENT,
    EngineConfig,
    EvaluationReport,
    PolicyEngine,
)
from policies._findings import (
    SEVERITIES,
    Evidence,
    Finding,
    Measurement,
    Severity,
    SuggestedChange,
    Threshold,
    more_severe,
    resource_key,
)
from policies._hardware import (
    GPU_SPECS,
    GpuSpec,
    critical_saturation,
    gpu_spec,
    pcie_lane_bandwidth_bytes_per_s,
    peak_memory_bandwidth_bytes_per_s,
    peak_pcie_bandwidth_bytes_per_s,
)
from policies._kv_cost import (
    ARTICLE_FP16_TO_INT4_RATIO,
    ARTICLE_HBM2E_ROW_ACCESS_S,
    ARTICLE_PCIE5_X16_MEASURED_BYTES_PER_S,
    HBM_ROW_BYTES,
    KvCompressionVerdict,
    hbm_row_accesses,
    kv_compression_tradeoff,
    kv_decompression_cost_s,
)
from policies._packed_codes import (
    dequantize,
    measure_dequantize_throughput,
    pack_uint,
    unpack_uint,
)
from policies._quantile import histogram_quantile
from policies._roi import (
    ARTICLE_GAMMA,
    ARTICLE_SCALE_OUT_GRID,
    ARTICLE_UTILISATION_GRID,
    equivalent_scale_out_nodes,
    payback_months,
    roi_delta,
    roi_matrix,
)
from policies._saturation import (
    ARTICLE_COUPLING_K,
    bandwidth_saturation,
    pressure_for_marginal_cost_ratio,
    saturation_marginal_cost_ratio,
)
from policies._state_db import DuplicateFindingError, FindingStore, findings_table, sqlite_url
from policies._window import JOB_ATTRIBUTE, FrameStore, ListableStore, StoreWindow, WindowSource

__all__ = [
    "ACTIVE_FINDINGS_METRIC",
    "Detector",
    "DuplicateFindingError",
    "ERRORS_METRIC",
    "EngineConfig",
    "EvaluationReport",
    "Evidence",
    "FINDING_CLOSED_EVENT",
    "FINDING_OPENED_EVENT",
    "Finding",
    "FindingStore",
    "FrameStore",
    "GPU_SPECS",
    "GpuSpec",
    "HBM_ROW_BYTES",
    "JOB_ATTRIBUTE",
    "KvCompressionVerdict",
    "ListableStore",
    "Measurement",
    "PolicyEngine",
    "ARTICLE_COUPLING_K",
    "ARTICLE_FP16_TO_INT4_RATIO",
    "ARTICLE_GAMMA",
    "ARTICLE_HBM2E_ROW_ACCESS_S",
    "ARTICLE_PCIE5_X16_MEASURED_BYTES_PER_S",
    "ARTICLE_SCALE_OUT_GRID",
    "ARTICLE_UTILISATION_GRID",
    "SEVERITIES",
    "SelfCheck",
    "Severity",
    "SplitCommunication",
    "StoreWindow",
    "SuggestedChange",
    "Threshold",
    "WindowSource",
    "allreduce_calls",
    "allreduce_time_s",
    "bandwidth_saturation",
    "critical_saturation",
    "dequantize",
    "equivalent_scale_out_nodes",
    "findings_table",
    "gpu_spec",
    "hbm_row_accesses",
    "histogram_quantile",
    "kv_compression_tradeoff",
    "kv_decompression_cost_s",
    "measure_dequantize_throughput",
    "microbatches_for_bubble",
    "more_severe",
    "pack_uint",
    "payback_months",
    "pcie_lane_bandwidth_bytes_per_s",
    "peak_memory_bandwidth_bytes_per_s",
    "peak_pcie_bandwidth_bytes_per_s",
    "pressure_for_marginal_cost_ratio",
    "resource_key",
    "ring_allreduce_bytes_per_rank",
    "roi_delta",
    "roi_matrix",
    "saturation_marginal_cost_ratio",
    "split_communication",
    "sqlite_url",
    "unpack_uint",
]
