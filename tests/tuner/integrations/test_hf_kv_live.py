"""Token agreement on live ``generate()`` traffic: ``ShadowCheck`` counts it through the job's
``ServingInstrumentation`` as the demo engine does, and a real sidecar's serving guardrail rolls
a KV width back from those counts.

The job is a random-init Llama-like model whose init is widened (0.2) so that its greedy tokens
depend on the cache: on this layout 8-bit keys and values pick the unquantised model's tokens
(agreement 1.0 measured on CPU), 2-bit ones about half of them (0.42). It serves in a thread,
one request at a time, with no in-job ``AgreementGuard``: the sidecar judges.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from collectors import TelemetryConfig, setup_telemetry
from collectors.names import (
    ATTR_SEEDANCE_CONFIG_VERSION,
    SERVE_QUALITY_AGREEING_TOKENS,
    SERVE_QUALITY_CHECKED_TOKENS,
)
from collectors.torch_serving import ServingInstrumentation
from tests.collectors._otel_points import metric_points
from tests.seedancectl._live import Live, live_sidecar
from tests.tuner.integrations._harness import counted, job_series
from tuner.integrations.hf_kv_cache import DecodeBoundary, LiveKVBits, ShadowCheck
from tuner.job import KV_BITS_KNOBS, ServeSession, attach_serving
from tuner.kv_cache import KVCacheError

JOB = "tiny"
LAYOUT: dict[str, Any] = {"group_size": 8, "residual_tokens": 8}
PROMPT, NEW_TOKENS = 16, 24
V3 = {ATTR_SEEDANCE_CONFIG_VERSION: 3}
BOUND = 0.9
"""The sidecar's least token agreement: 8 bits is above it, 2 bits far below."""


def tiny_llama() -> PreTrainedModel:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.2)).eval()


def generate(model: PreTrainedModel, ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    out: torch.Tensor = model.generate(  # type: ignore[operator]
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
        eos_token_id=None, pad_token_id=0, **kwargs)
    return out


def test_every_nth_output_is_checked_and_counted_for_its_version() -> None:
    model = tiny_llama()
    reader = InMemoryMetricReader()
    version = 3
    serving = ServingInstrumentation(MeterProvider([reader]).get_meter("test"),
                                     config_version=lambda: version)
    check = ShadowCheck(model, serving, every=2)
    g = torch.Generator().manual_seed(3)
    outs = [generate(model, torch.randint(1, 256, (2, PROMPT), generator=g),
                     cache=LiveKVBits(model.config, key_bits=2, value_bits=2, **LAYOUT).cache())
            for _ in range(4)]
    found = [check(out, PROMPT, version=3) for out in outs[:3]]
    assert found[0] is None and found[2] is None  # the 1st and 3rd are not sampled
    assert found[1] is not None and found[1].checked == 2 * NEW_TOKENS
    assert found[1].agreeing < found[1].checked  # 2 bits: greedy tokens drift
    version = 4  # the config changed while the 4th request ran: it counts for neither
    assert check(outs[3], PROMPT, version=3) is None and check.outputs == 4
    points = metric_points(reader)
    assert points[SERVE_QUALITY_CHECKED_TOKENS] == [{"attributes": V3, "value": 2 * NEW_TOKENS}]
    assert points[SERVE_QUALITY_AGREEING_TOKENS] == [{"attributes": V3,
                                                      "value": found[1].agreeing}]
    with pytest.raises(KVCacheError, match="every must be >= 1"):
        ShadowCheck(model, serving, every=0)


# -- under a real sidecar -----------------------------------------------------------------------


class GenerateJob:
    """The serving job, in a thread: generate() on the live KIVI cache, a lease boundary at
    every decode step, its telemetry (latency, tokens, checked tokens) over OTLP."""

    def __init__(self, url: str) -> None:
        self.model = tiny_llama()
        self.kv = LiveKVBits(self.model.config, key_bits=32, value_bits=32, **LAYOUT)
        self.session: ServeSession = attach_serving(
            job=JOB, sidecar=url, apply=self.kv.apply, knobs=KV_BITS_KNOBS,
            defaults=self.kv.defaults())
        self.telemetry = setup_telemetry(TelemetryConfig(
            job=JOB, otlp_endpoint=url, otlp_protocol="http/protobuf", export_interval_s=0.5))
        self.serving = ServingInstrumentation(self.telemetry.meter("test"),
                                              config_version=lambda: self.session.version)
        self.check = ShadowCheck(self.model, self.serving, every=2)
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        g = torch.Generator().manual_seed(3)
        try:
            for request in itertools.count():
                if self.stop.is_set():
                    return
                ids = torch.randint(1, 256, (1, PROMPT), generator=g)
                version = self.session.version
                self.serving.request_started(request)
                out = generate(self.model, ids, cache=self.kv.cache(),
                               logits_processor=[DecodeBoundary(self.session)])
                self.serving.first_token(request)
                for _ in range(NEW_TOKENS - 1):
                    self.serving.token(request)
                self.serving.request_finished(request, NEW_TOKENS)
                self.check(out, PROMPT, version=version)
        except BaseException as exc:  # reported by the test, not lost in the thread
            self.error = exc

    def close(self) -> None:
        self.stop.set()
        self.thread.join(30)
        self.session.close()
        self.telemetry.shutdown()


@pytest.fixture
def live(tmp_path: Path) -> Iterator[tuple[Live, GenerateJob]]:
    with live_sidecar(tmp_path, serving_slo={"min_token_agreement": BOUND}) as live:
        job = GenerateJob(live.url)
        try:
            deadline = time.monotonic() + 30
            while not any(j["job"] == JOB for j in live.get("/v1/jobs")):
                assert job.error is None and time.monotonic() < deadline, "no attach"
                time.sleep(0.05)
            yield live, job
        finally:
            job.close()
        assert job.error is None, repr(job.error)


def change_to(live: Live, bits: int) -> dict[str, Any]:
    """An operator's KV width, approved; the change once the job runs it (observing)."""
    reply = live.post(f"/v1/jobs/{JOB}/changes", {
        "values": {"kv.key_bits": bits, "kv.value_bits": bits}, "by": "oncall",
        "reason": f"{bits}-bit KV"})
    assert reply.status_code == 201, reply.text
    change = reply.json()
    if change["state"] == "proposed":
        approved = live.post(f"/v1/changes/{change['id']}/approve", {"by": "oncall"})
        assert approved.status_code == 200, approved.text
    return live.wait_state(change["id"], "observing", "rolled_back", "failed")


def checked_for(tmp_path: Path, version: int, at_least: int) -> tuple[int, int]:
    """(checked, agreeing) tokens the sidecar's store holds for ``version`` (bounded wait)."""
    def of(frame: Any) -> float:
        return counted(frame[frame[ATTR_SEEDANCE_CONFIG_VERSION].astype(int) == version])
    checked = of(job_series(tmp_path, SERVE_QUALITY_CHECKED_TOKENS,
                            until=lambda f: not f.empty and of(f) >= at_least))
    agreeing = of(job_series(tmp_path, SERVE_QUALITY_AGREEING_TOKENS))
    return int(checked), int(agreeing)


@pytest.mark.integration
def test_the_sidecar_rolls_back_a_width_that_agrees_badly_on_generate_traffic(
        live: tuple[Live, GenerateJob], tmp_path: Path) -> None:
    sidecar, job = live
    change = change_to(sidecar, 2)
    ended = sidecar.wait_state(change["id"], "rolled_back", "kept", "failed")
    assert ended["state"] == "rolled_back", ended
    reason = ended["plan"]["ended_because"]
    assert "checked tokens is below the bound 0.9000" in reason, reason
    version = int(change["plan"]["version"])
    checked, agreeing = checked_for(tmp_path, version, 1)
    assert 0 < checked and agreeing / checked < BOUND
    deadline = time.monotonic() + 20  # the job is back on its launch widths
    while job.kv.defaults() != {"kv.key_bits": 32, "kv.value_bits": 32}:
        assert time.monotonic() < deadline, job.kv.defaults()
        time.sleep(0.05)


@pytest.mark.integration
def test_a_width_that_agrees_well_is_not_rolled_back_for_agreement(
        live: tuple[Live, GenerateJob], tmp_path: Path) -> None:
    sidecar, job = live
    change = change_to(sidecar, 8)
    assert change["state"] == "observing", change
    version = int(change["plan"]["version"])
    # more checked tokens than a 2-bit width needs to be rolled back, all counted by the sidecar
    checked, agreeing = checked_for(tmp_path, version, 10 * NEW_TOKENS)
    assert checked >= 10 * NEW_TOKENS and agreeing / checked >= BOUND
    time.sleep(1.0)  # twenty of the controller's ticks with those counts in the store
    now = sidecar.get(f"/v1/changes/{change['id']}")
    # its windows may end it on latency or gain (8-bit codes cost time on a CPU), never on this
    assert "token agreement" not in (now["plan"].get("ended_because") or ""), now["plan"]
    if now["state"] == "observing":
        assert job.kv.defaults() == {"kv.key_bits": 8, "kv.value_bits": 8}
