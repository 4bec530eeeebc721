"""Detectors: each reads one window of a job's telemetry and returns findings with evidence."""

from policies.detectors._autoscaler_thrash import AutoscalerThrashDetector, ThrashConfig
from policies.detectors._bandwidth import BandwidthConfig, BandwidthSaturationDetector
from policies.detectors._collapse import (
    CollapseConfig,
    GradientCollapseDetector,
    article_collapse_step,
)
from policies.detectors._collective_parts import nvlink_peak_bytes_per_s
from policies.detectors._communication_degradation import (
    CommunicationConfig,
    CommunicationDegradationDetector,
)
from policies.detectors._gradient_parts import COLLAPSE, NON_FINITE, UNDERFLOW, locate_cause
from policies.detectors._input import InputBoundConfig, InputBoundDetector
from policies.detectors._kv_decompression_cost import (
    KvDecompressionConfig,
    KvDecompressionCostDetector,
)
from policies.detectors._load_imbalance import (
    ImbalanceConfig,
    LoadImbalanceDetector,
    rebalance_weight,
)
from policies.detectors._low_cache_hit_rate import LowCacheHitConfig, LowCacheHitRateDetector
from policies.detectors._nonfinite import (
    NonFiniteConfig,
    NonFiniteDetector,
    latest_nonfinite_reading_ns,
    nothing_nonfinite,
)
from policies.detectors._precision import SmallBatchPrecisionConfig, SmallBatchPrecisionDetector
from policies.detectors._priors import (
    EXPECTED_GAIN,
    ComputePriorsConfig,
    ComputePriorsDetector,
    amdahl_speedup,
)
from policies.detectors._request_latency import p99_per_interval
from policies.detectors._series import interval_increases
from policies.detectors._steps import BATCH_SIZE_ATTR, PRECISION_ATTR
from policies.detectors._tiny_buckets import TinyBucketConfig, TinyBucketDetector
from policies.detectors._underflow import GradientUnderflowDetector, UnderflowConfig

__all__ = [
    "COLLAPSE",
    "NON_FINITE",
    "UNDERFLOW",
    "AutoscalerThrashDetector",
    "BATCH_SIZE_ATTR",
    "BandwidthConfig",
    "BandwidthSaturationDetector",
    "CollapseConfig",
    "CommunicationConfig",
    "CommunicationDegradationDetector",
    "ComputePriorsConfig",
    "ComputePriorsDetector",
    "EXPECTED_GAIN",
    "GradientCollapseDetector",
    "GradientUnderflowDetector",
    "ImbalanceConfig",
    "InputBoundConfig",
    "InputBoundDetector",
    "KvDecompressionConfig",
    "KvDecompressionCostDetector",
    "LoadImbalanceDetector",
    "LowCacheHitConfig",
    "LowCacheHitRateDetector",
    "NonFiniteConfig",
    "NonFiniteDetector",
    "PRECISION_ATTR",
    "SmallBatchPrecisionConfig",
    "SmallBatchPrecisionDetector",
    "ThrashConfig",
    "TinyBucketConfig",
    "TinyBucketDetector",
    "UnderflowConfig",
    "amdahl_speedup",
    "interval_increases",
    "latest_nonfinite_reading_ns",
    "nothing_nonfinite",
    "locate_cause",
    "nvlink_peak_bytes_per_s",
    "p99_per_interval",
    "rebalance_weight",
    "article_collapse_step",
]
