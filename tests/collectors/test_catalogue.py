"""The catalogue's names are unique and well formed; docs/metrics.md and collectors/names.py are
its exact output."""

from __future__ import annotations

import re
import subprocess
import sys
import tokenize
from pathlib import Path

from collectors import names
from collectors._catalogue import CATALOGUE
from collectors.catalogue import render_markdown, render_names

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+$")
ATTRIBUTE = re.compile(r"^[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)*$")
UNIT = re.compile(r"^(1|\{[a-z_]+\}(/s)?|[A-Za-z]+(/s)?)$")


def test_docs_match_the_generator() -> None:
    expected = render_markdown()
    actual = (ROOT / "docs" / "metrics.md").read_text()
    assert actual == expected, "stale: python -m collectors.catalogue > docs/metrics.md"


def test_module_prints_the_same_page() -> None:
    out = subprocess.run([sys.executable, "-m", "collectors.catalogue"], cwd=ROOT,
                         capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout == render_markdown()


def test_name_constants_match_the_generator() -> None:
    actual = (ROOT / "collectors" / "names.py").read_text()
    assert actual == render_names(), "stale: python -m collectors.catalogue names > collectors/names.py"


def test_every_catalogue_name_and_attribute_has_its_constant() -> None:
    spelled = {v for k, v in vars(names).items() if k.isupper()}
    for spec in CATALOGUE:
        assert spec.name in spelled, spec.name
        assert set(spec.attributes) <= spelled, spec.name
    assert names.TRAIN_STEP_DURATION_BUCKET == "seedance.train.step.duration.bucket"


def test_names_are_unique() -> None:
    names = [spec.name for spec in CATALOGUE]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    assert not duplicates


def test_names_units_and_attributes_are_well_formed() -> None:
    for spec in CATALOGUE:
        assert NAME.match(spec.name), spec.name
        assert not spec.name.endswith((".bucket", ".count", ".sum")), spec.name
        assert not spec.name.endswith("_total"), spec.name
        assert spec.name.startswith(("hw.", "gen_ai.", "http.", "cpython.", "seedance.")), spec.name
        assert UNIT.match(spec.unit), (spec.name, spec.unit)
        assert spec.description and spec.source, spec.name
        assert len(set(spec.attributes)) == len(spec.attributes), spec.name
        for attribute in spec.attributes:
            assert ATTRIBUTE.match(attribute), (spec.name, attribute)


def test_every_name_has_exactly_one_row() -> None:
    page = render_markdown()
    for spec in CATALOGUE:
        assert page.count(f"\n| `{spec.name}` |") == 1, spec.name


def test_no_module_spells_a_catalogue_name_itself() -> None:
    """A metric name (or dotted attribute) is written once, in the catalogue; code uses its
    constant from ``collectors.names``, so a renamed metric cannot leave a stale copy behind."""
    dotted = {v for k, v in vars(names).items() if k.isupper() and "." in v}
    own = {ROOT / "collectors" / "_catalogue.py", ROOT / "collectors" / "names.py"}
    found = []
    for package in ("collectors", "policies", "tuner", "dashboards", "seedancectl", "workloads"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path in own:
                continue
            with path.open() as source:
                for token in tokenize.generate_tokens(source.readline):
                    text = token.string
                    if (token.type == tokenize.STRING and text[:1] in "\"'"
                            and not text.startswith(('"""', "'''")) and text[1:-1] in dotted):
                        found.append(f"{path.relative_to(ROOT)}:{token.start[0]} {text}")
    assert not found, "use collectors.names: " + "; ".join(found)
