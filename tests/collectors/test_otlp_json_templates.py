"""JSON templates decode repeat OTLP/JSON exports exactly as the fast path does, whatever width
their numbers take, and only when they safely can: a changed attribute, a malformed number or a
value JSON writes as a string goes to the reference path. Every test runs twice: templates read
in C (``collectors/csrc/json_template.c``) and by numpy, its reference; the C reader is also
held to the numpy one bit for bit on bodies fuzzed slot by slot and byte by byte."""

from __future__ import annotations

import json
import logging
import math
import random
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from collectors._otlp_decode import DecodedMetrics, OtlpDecodeError
from collectors._otlp_json import points_from_json
from collectors._otlp_json_templates import (
    _slots,
    build_json_template,
    json_templates,
    native_match,
)
from collectors._otlp_templates import ExportTemplates
from tests.collectors.test_otlp_json_shapes import as_json, sunk_alike
from tests.collectors.test_otlp_templates import DATA, gauges, sdk_exports

HAS_COMPILER = any(shutil.which(cc) for cc in ("cc", "gcc"))


@pytest.fixture(autouse=True, params=["native", "numpy"])
def reader(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Templates read in C, then by numpy (``SEEDANCE_JSON_NATIVE=0``)."""
    native = request.param == "native"
    if native and not HAS_COMPILER:
        pytest.skip("no C compiler: the numpy reader runs alone")
    monkeypatch.setenv("SEEDANCE_JSON_NATIVE", "1" if native else "0")
    native_match.cache_clear()
    assert (native_match() is not None) == native
    yield request.param
    native_match.cache_clear()


def templates() -> ExportTemplates:
    return json_templates(points_from_json, points_from_json)


def compact(body: bytes) -> bytes:
    """As encoders without spaces write it (JavaScript's JSON.stringify, Go's protojson in
    one of its two spacings)."""
    return json.dumps(json.loads(body), separators=(",", ":")).encode()


def same(decoded: DecodedMetrics, body: bytes) -> None:
    expected = points_from_json(body)
    assert decoded.points == expected.points
    assert [math.copysign(1, p.value) for p in decoded.points] == \
        [math.copysign(1, p.value) for p in expected.points]
    assert decoded.metrics == expected.metrics


def with_values(body: bytes, values: Callable[[int], str]) -> bytes:
    """``body`` with the n-th ``asDouble`` written as ``values(n)``, verbatim."""
    counter = iter(range(10**9))
    return re.sub(rb'("asDouble":\s*)[^,}]+',
                  lambda m: m.group(1) + values(next(counter)).encode(), body)


@pytest.mark.parametrize("spacing", [lambda b: b, compact], ids=["spaced", "compact"])
@pytest.mark.parametrize("delta", [False, True], ids=["cumulative", "delta"])
def test_repeat_sdk_exports_decode_from_a_template_exactly(
        spacing: Callable[[bytes], bytes], delta: bool) -> None:
    """Gauges, int and double counters and histograms of a real SDK, as JSON."""
    decoder = templates()
    for body in (spacing(as_json(b)) for b in sdk_exports(6, delta=delta)):
        same(decoder.decode(body), body)
    assert decoder.builds == 1
    assert decoder.hits == 4  # seen, built, then four from the template


def test_numbers_of_every_width_and_form_decode_bit_for_bit() -> None:
    """Values change width between exports (and so do the runs of the body): shortest
    round-trip doubles, exponents, negatives, integers, zeros."""
    rng = random.Random(7)
    forms = [lambda: repr(rng.uniform(-1e3, 1e3)), lambda: repr(rng.uniform(0, 1) * 1e-9),
             lambda: repr(rng.uniform(1, 2) * 1e300), lambda: str(rng.randint(-10**6, 10**6)),
             lambda: "0", lambda: "-0.0", lambda: "1E+5", lambda: "2.5e-3", lambda: "0.5"]
    decoder = templates()
    base = as_json(gauges(64, stamp=0))
    hits = 0
    for export in range(30):
        body = with_values(base.replace(b"1700000000000000000", str(
            1_700_000_000_000_000_000 + export).encode()),
            lambda n: rng.choice(forms)())
        decoded = decoder.decode(body)
        hits += decoded is not None and export >= 2
        same(decoded, body)
    assert decoder.hits == 28


def test_a_changed_number_inside_an_attribute_is_another_shape() -> None:
    """Numbers in keys and strings are text, not slots: ``layer012`` becoming ``layer013`` at
    the same place and width must not pass for the old shape."""
    decoder = templates()
    bodies = [as_json(gauges(40, stamp=s)) for s in range(3)]
    for body in bodies:
        decoder.decode(body)
    assert decoder.hits == 1
    renamed = bodies[2].replace(b'"layer012"', b'"layer013"')
    assert renamed != bodies[2] and len(renamed) == len(bodies[2])
    decoded = decoder.decode(renamed)
    same(decoded, renamed)
    assert decoder.hits == 1
    assert decoded.points[12].attributes["module"] == "layer013"


@pytest.mark.parametrize("text", ["01.5", "1.", ".5", "-.5", "1.e5", "1e", "--1", "1-2", "-",
                                  "1e400", "-0", "1.2.3", "0x10", "Infinity", '"NaN"'])
def test_a_malformed_or_special_number_in_a_known_shape_is_read_as_the_fast_path_reads_it(
        text: str) -> None:
    """The fast path refuses what JSON refuses; the template must not be laxer."""
    decoder = templates()
    base = as_json(gauges(40, stamp=0))
    for stamp in range(3):
        decoder.decode(with_values(base, lambda n: f"{n}.25").replace(
            b"1700000000000000000", str(1_700_000_000_000_000_000 + stamp).encode()))
    assert decoder.hits == 1
    odd = with_values(base, lambda n: text if n == 5 else f"{n}.25")
    try:
        expected = points_from_json(odd)
    except OtlpDecodeError:
        with pytest.raises(OtlpDecodeError):
            decoder.decode(odd)
    else:
        got = decoder.decode(odd)
        assert [(p.name, p.time_ns, p.attributes) for p in got.points] == \
            [(p.name, p.time_ns, p.attributes) for p in expected.points]
        assert [repr(p.value) for p in got.points] == [repr(p.value) for p in expected.points]


def test_times_past_int64_and_bare_integer_buckets_keep_the_reference_answer() -> None:
    decoder = templates()
    late = as_json(gauges(20, stamp=0)).replace(b"1700000000000000000",
                                                 str(2**63 + 5).encode())
    for _ in range(3):
        same(decoder.decode(late), late)
    assert decoder.decode(late).points[0].time_ns == 2**63 + 5
    # bucket counts as bare numbers (allowed for 64-bit ints): decoded right, templated or not
    for body in sdk_exports(4):
        bare = re.sub(rb'"(\d+)"(?=[,\]])', rb"\1", as_json(body))
        same(decoder.decode(bare), bare)


def test_a_shape_the_template_cannot_hold_builds_none() -> None:
    """NaN written as a string sits in the text, not a slot, so no value reads it."""
    body = with_values(as_json(gauges(20, stamp=0)), lambda n: '"NaN"' if n == 3 else "1.5")
    assert build_json_template(body, points_from_json) is None
    assert build_json_template(as_json(gauges(20, stamp=0)), points_from_json) is not None


def test_exporters_are_told_apart_by_their_resource() -> None:
    decoder = templates()
    for stamp in range(3):
        for rank in "01":
            body = as_json(gauges(30, stamp=stamp, rank=rank))
            same(decoder.decode(body), body)
    assert decoder.builds == 2 and decoder.hits == 2


def test_repeat_json_exports_from_templates_land_where_their_points_would(
        tmp_path: Path) -> None:
    """Store rows, /metrics and limiter counts, fed template columns or the same exports'
    Points."""
    decoder = templates()
    sunk_alike(decoder.decode, [compact(as_json(b)) for b in [
        *sdk_exports(5, delta=True), *(gauges(40, stamp=s, version=v) for v in "12"
                                       for s in range(4))]], tmp_path)
    assert decoder.hits >= 6


def test_the_opentelemetry_proto_example_decodes_as_the_fast_path_reads_it() -> None:
    """Its exponential histograms, summaries and exemplars are the reference path's; tripled
    (36 points, enough for a template), its repeats must still decode exactly."""
    example = json.loads((DATA / "otlp_opentelemetry-proto_examples_metrics.json").read_bytes())
    example["resourceMetrics"] *= 3
    decoder = templates()
    for spacing in (lambda b: b, compact, compact, compact):
        body = spacing(json.dumps(example).encode())
        same(decoder.decode(body), body)
    assert len(points_from_json(body).points) >= 36


NUMBER_TEXTS = ["0", "-0", "7", "007", "00", "-5", "1.5", "-0.0", "-1.5e-3", "1E+5", "2.5e-3",
                "1e5", "1e0001", "1e400", "-1e400", "1e-400", "4.9e-324", "01", "01.5", "1.",
                ".5", "-.5", "1.e5", "1e", "1e+", "--1", "1-2", "-", "1.2.3", "1e5e5",
                "18446744073709551615", "9999999999999999999", "10000000000000000000",
                "9223372036854775807", "9223372036854775808", "-9223372036854775808",
                "-9223372036854775809", "1" * 32, "1" * 33, "0." + "1" * 31, "0." + "1" * 30]


def valid_number(kind: str, rng: random.Random) -> str:
    """A number the fast path reads in a slot of ``kind``, of random width."""
    if kind == "int":
        return str(rng.randint(-2**63, 2**63 - 1) // 10 ** rng.randint(0, 18))
    if kind == "double":
        return repr(rng.uniform(-1, 1) * 10.0 ** rng.randint(-300, 300))
    return str(rng.randrange(10 ** rng.randint(1, 19)))


def fuzzed(body: bytes, rng: random.Random) -> bytes:
    """``body`` with a few slots rewritten (mostly numbers their kind allows, else tricky
    texts), or one byte changed, inserted or dropped anywhere."""
    if rng.random() < 0.2:
        at = rng.randrange(len(body))
        return rng.choice([body[:at] + bytes([rng.randrange(32, 127)]) + body[at + 1:],
                           body[:at] + bytes([rng.randrange(32, 127)]) + body[at:],
                           body[:at] + body[at + 1:]])
    spans, kinds, _ = _slots(body)
    out, last = [], 0
    for i in sorted(rng.sample(range(len(spans)), k=min(len(spans), rng.randint(1, 6)))):
        start, end = spans[i]
        text = valid_number(kinds[i], rng) if rng.random() < 0.9 else rng.choice(NUMBER_TEXTS)
        out += [body[last:start], text.encode()]
        last = end
    out.append(body[last:])
    return b"".join(out)


def test_the_c_reader_reads_every_body_as_numpy_does_bit_for_bit(reader: str) -> None:
    """Histograms (bucket counts), int and double counters, gauges; every fuzzed body is
    either refused by both readers or read to the same words and value bits."""
    if reader != "native":
        pytest.skip("compares the two readers once")
    match = native_match()
    assert match is not None
    rng = random.Random(11)
    bodies = [compact(as_json(b)) for b in sdk_exports(3)]
    template = build_json_template(bodies[-1], points_from_json)
    assert template is not None
    read = refused = 0
    for _ in range(3000):
        body = fuzzed(bodies[-1], rng)
        numpy_read = template._read(body)
        native_read = template._read_native(match, body)
        assert (numpy_read is None) == (native_read is None), body
        if numpy_read is None or native_read is None:
            refused += 1
            continue
        read += 1
        assert np.array_equal(numpy_read[0], native_read[0])
        assert np.array_equal(numpy_read[1].view(np.uint64), native_read[1].view(np.uint64))
    assert read > 1500 and refused > 500, (read, refused)  # both decisions exercised


def test_without_a_compiler_json_templates_fall_back_to_numpy_and_leave_nothing(
        reader: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    if reader != "native":
        pytest.skip("the numpy reader is the fallback itself")
    monkeypatch.setenv("SEEDANCE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    native_match.cache_clear()
    with caplog.at_level(logging.WARNING, logger="collectors._otlp_json_templates"):
        assert native_match() is None
    (record,) = caplog.records
    assert "slower numpy path" in record.getMessage()
    assert list(tmp_path.iterdir()) == []  # no half-written library
    decoder = templates()
    for stamp in range(4):
        body = as_json(gauges(30, stamp=stamp))
        same(decoder.decode(body), body)
    assert decoder.hits == 2


def test_without_a_compiler_the_library_built_ahead_reads_the_templates(
        reader: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """A container image has no compiler: ``python -m collectors._native`` builds the
    sidecar's library ahead (its build stage), and the sidecar loads that one."""
    if reader != "native":
        pytest.skip("the numpy reader is the fallback itself")
    import subprocess
    import sys

    from collectors._native import JSON_TEMPLATE_SOURCE, prebuilt_path
    monkeypatch.setenv("SEEDANCE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    built = subprocess.run([sys.executable, "-m", "collectors._native"], check=True,
                           capture_output=True, text=True).stdout.split()
    assert built == [str(prebuilt_path(JSON_TEMPLATE_SOURCE))]
    empty = tmp_path / "no-compilers"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))  # no cc, no gcc: as in the image
    native_match.cache_clear()
    assert native_match() is not None
    decoder = templates()
    for stamp in range(4):
        body = as_json(gauges(30, stamp=stamp))
        same(decoder.decode(body), body)
    assert decoder.hits == 2
    # nothing built ahead, no compiler: the numpy path, and the warning says where it looked
    Path(built[0]).unlink()
    native_match.cache_clear()
    with caplog.at_level(logging.WARNING, logger="collectors._otlp_json_templates"):
        assert native_match() is None
    (record,) = caplog.records
    assert "no library built ahead" in record.getMessage() and built[0] in record.getMessage()
