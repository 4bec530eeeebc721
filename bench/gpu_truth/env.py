"""The machine the GPU truth ran on: the environment header, ``nvidia-smi -q`` as raw text
(``nvidia-smi-q.txt``), and the versions of the packages the parts use.

    python -m bench.gpu_truth.env --out bench/results/gpu
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
from pathlib import Path

from bench.gpu_truth._record import Part, parser

PACKAGES = ("torch", "nvidia-ml-py", "numpy", "opentelemetry-sdk", "fastapi", "sqlalchemy",
            "pydantic", "optuna", "triton")


def main(argv: list[str] | None = None) -> Path:
    args = parser(__doc__).parse_args(argv)
    part = Part("env", args.out, simulated=args.cpu)
    part.data["cpus"] = os.cpu_count()
    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    part.data["packages"] = versions
    with part.attempt("nvidia-smi -q"):
        if shutil.which("nvidia-smi") is None:
            raise FileNotFoundError("nvidia-smi is not on the PATH")
        text = subprocess.run(["nvidia-smi", "-q"], capture_output=True, text=True,
                              timeout=60, check=True).stdout
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "nvidia-smi-q.txt").write_text(text)
        part.data["nvidia_smi_q"] = "nvidia-smi-q.txt"
    return part.write()


if __name__ == "__main__":
    main()
