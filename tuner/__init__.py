"""Changing things: knobs, search, approvals, rollout, the knob lease and in-job actuators.

Public names load their module on first use; each is listed once, as a typed import under
``TYPE_CHECKING`` that ``collectors.lazy_exports`` reads. In-job modules that import torch
(``tuner.job``'s sessions, ``tuner.precision``, ``tuner.checkpoint``, ``tuner.kv_cache``,
``tuner.kv_decode``, ``tuner.kv_adaptive``, and the framework adapters ``tuner.integrations.hf``,
``tuner.integrations.lightning`` and ``tuner.integrations.hf_kv_cache``) are imported by the job
directly, never from here, so the sidecar stays torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from collectors import lazy_exports

if TYPE_CHECKING:
    from tuner._ceilings import observed_ceilings as observed_ceilings
    from tuner._change import ACTIVE as ACTIVE
    from tuner._change import MANUAL as MANUAL
    from tuner._change import STOPPED as STOPPED
    from tuner._change import TRANSITIONS as TRANSITIONS
    from tuner._change import Change as Change
    from tuner._change import ChangeCursor as ChangeCursor
    from tuner._change import IllegalTransition as IllegalTransition
    from tuner._change import RolloutError as RolloutError
    from tuner._change import Trip as Trip
    from tuner._compare import compare as compare
    from tuner._fleet import FleetMember as FleetMember
    from tuner._fleet_directory import DEFAULT_HEARTBEAT_S as DEFAULT_HEARTBEAT_S
    from tuner._fleet_directory import FleetDirectory as FleetDirectory
    from tuner._fleet_directory import FleetJob as FleetJob
    from tuner._fleet_directory import FleetSidecar as FleetSidecar
    from tuner._fleet_directory import stale_after_s as stale_after_s
    from tuner._fleet_distance import NEAR_DISTANCE as NEAR_DISTANCE
    from tuner._fleet_distance import fingerprint_distance as fingerprint_distance
    from tuner._fleet_jobs import FleetJobs as FleetJobs
    from tuner._fleet_priors import FLEET_HALVED_WHY as FLEET_HALVED_WHY
    from tuner._fleet_priors import FLEET_TIE_WHY as FLEET_TIE_WHY
    from tuner._fleet_priors import FLEET_WHY as FLEET_WHY
    from tuner._fleet_priors import FleetPriors as FleetPriors
    from tuner._fleet_priors import FleetSource as FleetSource
    from tuner._fleet_priors import NoFingerprintError as NoFingerprintError
    from tuner._fleet_priors import compounded_gain as compounded_gain
    from tuner._fleet_priors import fleet_moves as fleet_moves
    from tuner._fleet_priors import fleet_source_of as fleet_source_of
    from tuner._fleet_priors import lead_kind as lead_kind
    from tuner._guardrails import GradientCollapseFindings as GradientCollapseFindings
    from tuner._guardrails import Guardrail as Guardrail
    from tuner._guardrails import NonFiniteValues as NonFiniteValues
    from tuner._journal import ChangeJournal as ChangeJournal
    from tuner._knobs import Config as Config
    from tuner._knobs import Knob as Knob
    from tuner._knobs import KnobError as KnobError
    from tuner._knobs import KnobSpace as KnobSpace
    from tuner._knobs import KnobValue as KnobValue
    from tuner._lease import JobRegistry as JobRegistry
    from tuner._lease_http import Credentials as Credentials
    from tuner._lease_http import lease_router as lease_router
    from tuner._lease_messages import Ack as Ack
    from tuner._lease_messages import JobClaimedError as JobClaimedError
    from tuner._lease_messages import JobStatus as JobStatus
    from tuner._lease_messages import Lease as Lease
    from tuner._lease_messages import LeaseError as LeaseError
    from tuner._lease_messages import UnknownJobError as UnknownJobError
    from tuner._measure import JOB_ATTR as JOB_ATTR
    from tuner._measure import TOKENS_PER_SECOND as TOKENS_PER_SECOND
    from tuner._measure import measure_window as measure_window
    from tuner._restore import Restore as Restore
    from tuner._rollout import RolloutController as RolloutController
    from tuner._sampler import NeighbourhoodSampler as NeighbourhoodSampler
    from tuner._search import SearchDriver as SearchDriver
    from tuner._search_config import SearchConfig as SearchConfig
    from tuner._space import suggestions as suggestions
    from tuner._space import within_bounds as within_bounds
    from tuner._state_tables import STATE_TABLES as STATE_TABLES
    from tuner._token import DEFAULT_TOKEN_FILE as DEFAULT_TOKEN_FILE
    from tuner._token import TOKEN_ENV as TOKEN_ENV
    from tuner._token import TOKEN_FILE_ENV as TOKEN_FILE_ENV
    from tuner._token import TokenError as TokenError
    from tuner._token import find_token as find_token
    from tuner._token import read_token as read_token
    from tuner._tuning_loop import TuningLoop as TuningLoop
    from tuner._verdict import RolloutConfig as RolloutConfig
    from tuner._versions import VersionLedger as VersionLedger
    from tuner._windows import Comparison as Comparison
    from tuner._windows import MeasureConfig as MeasureConfig
    from tuner._windows import Window as Window
    from tuner.prefix_cache import PREFIX_CACHE_KNOBS as PREFIX_CACHE_KNOBS
    from tuner.prefix_cache import PrefixCache as PrefixCache
    from tuner.prefix_cache import PrefixCacheConfig as PrefixCacheConfig
    from tuner.routing import ROUTING_KNOBS as ROUTING_KNOBS
    from tuner.routing import SHARDING_KNOB as SHARDING_KNOB
    from tuner.routing import LoadAwareRouter as LoadAwareRouter
    from tuner.routing import RoundRobinRouter as RoundRobinRouter
    from tuner.serving_guardrails import ServingSLOGuardrail as ServingSLOGuardrail
    from tuner.serving_guardrails import check_guardrails as check_guardrails

if not TYPE_CHECKING:  # a __getattr__ that mypy saw would type every misspelt name as Any
    __all__, __getattr__, __dir__ = lazy_exports(globals())
