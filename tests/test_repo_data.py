"""The repository carries the data its tests and scripts read: a clone anywhere runs them.

Real captures from other projects are copied into ``tests/data/`` with their source and licence
in its README; code reads them by a path relative to the repository, never from the folder they
were first collected in.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
CODE_SUFFIXES = {".py", ".sh", ".toml", ".cfg", ".ini", ".yml", ".yaml"}
CODE_NAMES = {"Dockerfile", "run"}  # .ci/run
SKIPPED_DIRS = {".git", ".venv", "__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache",
                ".benchmarks", "build", "dist", "out", "test-artifacts", "seedance-data",
                "seedance-demo"}
OUTSIDE = re.compile(r"/work/|\.\./shared\b|\bshared/data\b|real-samples")
"""Where the samples were first collected, and the checkout's own absolute path."""


def code_files() -> list[Path]:
    """Every source, script and config file of the repository (not its build outputs)."""
    found = []
    for path in ROOT.rglob("*"):
        parts = path.relative_to(ROOT).parts
        if any(p in SKIPPED_DIRS or p.endswith(".egg-info") for p in parts[:-1]):
            continue
        if path.is_file() and (path.suffix in CODE_SUFFIXES or path.name in CODE_NAMES):
            found.append(path)
    return found


def test_no_code_refers_to_a_path_outside_the_repository() -> None:
    files = [f for f in code_files() if f != Path(__file__).resolve()]
    assert any(f.name == "build_from_captures.py" for f in files)  # the scan sees the code
    hits = [f"{f.relative_to(ROOT)}:{n}: {line.strip()}"
            for f in files
            for n, line in enumerate(f.read_text(encoding="utf-8", errors="replace")
                                     .splitlines(), 1)
            if OUTSIDE.search(line)]
    assert not hits, "paths outside the repository:\n" + "\n".join(hits)


def test_every_copied_sample_names_its_source_and_licence() -> None:
    rows = {}
    for line in (DATA / "README.md").read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) == 4:
            rows[cells[0]] = cells
    samples = [p.name for p in DATA.iterdir() if p.is_file() and p.name != "README.md"]
    assert samples
    for name in samples:
        assert name in rows, f"tests/data/{name} has no row in tests/data/README.md"
        _, source, licence, _ = rows[name]
        assert "@" in source and licence, f"tests/data/{name}: source commit or licence missing"
    for folder in (p for p in DATA.iterdir() if p.is_dir()):
        assert (folder / "README.md").is_file(), f"tests/data/{folder.name} has no README.md"
