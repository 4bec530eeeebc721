"""One line per part of a GPU-truth run: its errors and every target it met or missed, read
back from the parts' JSONs into ``summary.json`` (what a reader opens first).

    python -m bench.gpu_truth.summary --out bench/results/gpu
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.gpu_truth._record import Part, parser


def targets(doc: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(where, met) of every target check (a dict with ``met`` and ``target``) in ``doc``."""
    if isinstance(doc, dict):
        if "met" in doc and "target" in doc:
            yield path, doc["met"]
            return
        for key, value in doc.items():
            yield from targets(value, f"{path}.{key}" if path else str(key))


def main(argv: list[str] | None = None) -> Path:
    args = parser(__doc__).parse_args(argv)
    part = Part("summary", args.out, simulated=args.cpu)
    parts: dict[str, dict[str, Any]] = {}
    for path in sorted(args.out.glob("*.json")):
        if path.stem in ("summary", "overhead_raw"):
            continue
        try:
            doc = json.loads(path.read_text())
        except ValueError as e:
            part.errors[path.name] = f"unreadable: {e}"
            continue
        parts[path.stem] = {"errors": sorted(doc.get("errors", {})),
                            "simulated": doc.get("environment", {}).get("simulated"),
                            "targets": dict(targets(doc))}
        met = parts[path.stem]["targets"]
        print(f"{path.stem:>9}: {len(parts[path.stem]['errors'])} error(s); targets "
              + (", ".join(f"{k} {'met' if v else 'NOT met' if v is False else 'unmeasured'}"
                           for k, v in met.items()) or "none"))
    part.data["parts"] = parts
    return part.write()


if __name__ == "__main__":
    main()
