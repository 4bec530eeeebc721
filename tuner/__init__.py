"""Changing things: knobs, search, approvals, rollout, the knob lease and in-job actuators.

Public names load their module on first use. In-job modules that import torch
(``tuner.client``, ``tuner.precision``, ``tuner.checkpoint``, ``tuner.kv_cache``,
``tuner.kv_decode``, ``tuner.kv_adaptive``) are imported by the job directly, never from here,
so the sidecar stays torch-free.
"""

from __future__ import annotations

from collectors._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "Knob": "_knobs", "KnobSpace": "_knobs", "Config": "_knobs", "KnobError": "_knobs",
    "JobRegistry": "_lease", "JobStatus": "_lease", "Ack": "_lease", "Lease": "_lease",
    "LeaseError": "_lease", "lease_router": "_lease",
    "RolloutController": "_rollout", "RolloutConfig": "_rollout", "Change": "_rollout",
    "Guardrail": "_rollout", "Trip": "_rollout", "NonFiniteLoss": "_rollout",
    "GradientCollapseFindings": "_rollout", "RolloutError": "_rollout",
    "IllegalTransition": "_rollout", "TRANSITIONS": "_rollout",
    "MeasureConfig": "_measure", "Window": "_measure", "Comparison": "_measure",
    "measure_window": "_measure", "compare": "_measure",
    "SearchDriver": "_search", "SearchConfig": "_search", "NeighbourhoodSampler": "_search",
    "TuningLoop": "_search", "suggestions": "_search",
    "PrefixCache": "prefix_cache", "PrefixCacheConfig": "prefix_cache",
    "PREFIX_CACHE_KNOBS": "prefix_cache",
    "LoadAwareRouter": "routing", "RoundRobinRouter": "routing", "ROUTING_KNOBS": "routing",
    "SHARDING_KNOB": "routing",
    "check_guardrails": "serving_guardrails", "ServingSLOGuardrail": "serving_guardrails",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
