"""Benchmark: the KIVI cache (``tuner.integrations.hf_kv_cache.KiviCache``) against
transformers' own caches under ``model.generate()``, on a random-init Llama-like model on CPU.

Caches: ``DynamicCache`` (unquantised, the baseline), ``KiviCache`` at k8v8 / k4v4 / k2v2, and
transformers' ``QuantizedCache`` with each backend that installs and runs here (``quanto``
2 / 4 bits, ``hqq`` 2 / 4 bits, ``fp8``); a backend that fails is recorded with its error.
For each, over ``--rounds`` rounds with the order rotated every round (A/B interleaved):

- ``bytes_per_token``: every tensor the cache holds after the run (packed codes, scales,
  zeros, residual window; a quantised tensor subclass counted by its inner tensors) over
  batch x tokens held;
- ``decode_tokens_per_s``: batch / the median time between two decode steps (a logits
  processor stamps each step), median over rounds;
- ``agreement``: teacher-forced token agreement with the unquantised model
  (``token_agreement``: the share of generated tokens a cache-free forward also picks).

Random weights: the work per step does not depend on them, and agreement only ranks the caches
on this model (a trained model's logits are sharper). Writes bench/results/hf_kv_cache.json.

    python bench/hf_kv_cache.py             # about 2-3 minutes on 2 loaded cores
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import (
    Cache,
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    LogitsProcessor,
    QuantizedCache,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._targets import Target, holds, judged  # noqa: E402
from tuner.integrations.hf_kv_cache import KiviCache, token_agreement  # noqa: E402

CacheMaker = Callable[[], Cache]


def targets(report: dict[str, Any]) -> list[Target]:
    """Each KIVI width holds fewer bytes per token than the unquantised cache.

    Issue #15 item 3 asks for the comparison and states no target; issue #5 asks of the KIVI
    layout that the memory it holds really shrinks, measured. Agreement is not judged: on
    random weights it only ranks the caches (see above).
    """
    return [holds(f"{name} bytes per token / DynamicCache's", "< 1", row["memory_vs_dynamic"],
                  row["memory_vs_dynamic"] < 1,
                  "issue #5 (the memory it holds must really shrink); #15 states none")
            for name, row in report["caches"].items() if name.startswith("kivi_")]


class StepClock(LogitsProcessor):
    """Stamps every decode step (called once per generated token)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.LongTensor,
                 scores: torch.FloatTensor) -> torch.FloatTensor:
        self.stamps.append(time.perf_counter())
        return scores


def _tensors(obj: Any, out: dict[int, torch.Tensor]) -> None:
    """Every tensor reachable from ``obj`` (a tensor subclass by its inner tensors)."""
    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "__tensor_flatten__") and type(obj) is not torch.Tensor:
            names, _ = obj.__tensor_flatten__()
            for name in names:
                _tensors(getattr(obj, name), out)
        elif obj.numel():
            out[obj.untyped_storage().data_ptr()] = obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            _tensors(item, out)
    elif isinstance(obj, dict):
        for item in obj.values():
            _tensors(item, out)


def cache_bytes(cache: Cache) -> int:
    """Bytes of every tensor the cache's layers hold (shared storage counted once)."""
    found: dict[int, torch.Tensor] = {}
    for layer in cache.layers:
        store = getattr(layer, "store", None)
        if store is not None:  # KiviLayer
            _tensors(store.tensors(), found)
        _tensors([v for k, v in vars(layer).items() if k != "store"], found)
    return sum(t.untyped_storage().nbytes() for t in found.values())


def makers(config: LlamaConfig, group: int, residual: int) -> dict[str, CacheMaker]:
    out: dict[str, CacheMaker] = {"dynamic": lambda: DynamicCache(config=config)}
    for bits in (8, 4, 2):
        out[f"kivi_k{bits}v{bits}"] = (lambda b: lambda: KiviCache(
            config, key_bits=b, value_bits=b, group_size=group, residual_tokens=residual))(bits)
    for backend, bits, axis in (("quanto", 4, 0), ("quanto", 2, 0), ("hqq", 4, 1),
                                ("hqq", 2, 1)):
        out[f"hf_{backend}_{bits}bit"] = (lambda be, b, a: lambda: QuantizedCache(
            be, config, nbits=b, q_group_size=group, residual_length=residual, axis_key=a,
            axis_value=a))(backend, bits, axis)
    out["hf_fp8"] = lambda: QuantizedCache("fp8", config)
    return out


def run_once(model: LlamaForCausalLM, prompts: torch.Tensor, make: CacheMaker,
             new_tokens: int) -> dict[str, Any]:
    cache, clock = make(), StepClock()
    with torch.no_grad():
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), cache=cache,
                             logits_processor=[clock], max_new_tokens=new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    steps = [b - a for a, b in zip(clock.stamps, clock.stamps[1:], strict=False)]
    held = prompts.shape[1] + new_tokens - 1
    return {"step_s": statistics.median(steps), "out": out,
            "bytes_per_token": cache_bytes(cache) / (prompts.shape[0] * held)}


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--group-size", type=int, default=32)
    p.add_argument("--residual", type=int, default=32)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "hf_kv_cache.json"))
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=1024)
    model = LlamaForCausalLM(config).eval()
    prompts = torch.randint(1, config.vocab_size, (args.batch, args.prompt),
                            generator=torch.Generator().manual_seed(1))
    caches = makers(config, args.group_size, args.residual)
    errors: dict[str, str] = {}
    for name, make in caches.items():  # warm-up; a backend that cannot run here drops out
        try:
            run_once(model, prompts[:, :8], make, 4)
        except Exception as exc:  # noqa: BLE001 - recorded as the backend's result
            errors[name] = f"{type(exc).__name__}: {exc}"[:300]
    names = [n for n in caches if n not in errors]
    step_s: dict[str, list[float]] = {n: [] for n in names}
    results: dict[str, dict[str, Any]] = {}
    started = time.perf_counter()
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            once = run_once(model, prompts, caches[name], args.new_tokens)
            step_s[name].append(once["step_s"])
            if r == 0:
                agreement = token_agreement(model, once["out"], args.prompt)
                results[name] = {"bytes_per_token": round(once["bytes_per_token"], 1),
                                 "agreement": round(agreement.share, 4),
                                 "checked_tokens": agreement.checked}
    base = statistics.median(step_s["dynamic"])
    for name in names:
        med = statistics.median(step_s[name])
        results[name].update({
            "decode_step_ms": round(med * 1e3, 3),
            "decode_step_ms_rounds": [round(s * 1e3, 3) for s in step_s[name]],
            "decode_tokens_per_s": round(args.batch / med, 1),
            "step_vs_dynamic": round(med / base, 3),
            "memory_vs_dynamic": round(results[name]["bytes_per_token"]
                                       / results["dynamic"]["bytes_per_token"], 4)})
    report = {
        "what": "KiviCache vs transformers' caches under generate(), random-init Llama-like, "
                "CPU; A/B interleaved rounds, medians",
        "args": vars(args),
        "model": {"layers": 4, "hidden": 256, "heads": 8, "kv_heads": 4, "head_dim": 32},
        "machine": {"platform": platform.platform(), "threads": torch.get_num_threads()},
        "versions": {n: _version(n) for n in ("torch", "transformers", "optimum-quanto",
                                              "hqq")},
        "seconds": round(time.perf_counter() - started, 1),
        "caches": results,
        "not_run": errors,
    }
    report = judged(report, targets(report))
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    for name, row in results.items():
        print(f"{name:18s} {row['bytes_per_token']:9.1f} B/tok  {row['decode_tokens_per_s']:8.1f}"
              f" tok/s  agreement {row['agreement']:.3f}")
    for name, error in errors.items():
        print(f"{name:18s} not run: {error}")


if __name__ == "__main__":
    main()
