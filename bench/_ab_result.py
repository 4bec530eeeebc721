"""The results file of a bench that runs old code against new: one envelope for all of them."""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from bench._targets import Target, judged

Runs = Mapping[str, list[Mapping[str, list[float]]]]
"""arm -> one entry per run -> operation -> its timings (ms)."""


def write_ab_result(path: Path, *, bench: str, protocol: Mapping[str, Any],
                    summary: Mapping[str, Any], runs: Runs,
                    targets: Callable[[dict[str, Any]], Iterable[Target]]) -> None:
    """Write ``path``: when and where it ran, how, the summary, every timing (to the µs) and
    the targets judged from the result, then print the summary."""
    result: dict[str, Any] = {
        "bench": bench,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version()},
        "protocol": dict(protocol),
        "summary": dict(summary),
        "runs": {arm: [{op: [round(x, 3) for x in v] for op, v in run.items()} for run in rs]
                 for arm, rs in runs.items()}}
    result = judged(result, targets(result))
    path.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(summary, indent=1))
