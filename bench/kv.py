"""Benchmark: quantised KV cache per bit-width: bytes, decode speed, dequantise cost, quality.

For each width (32 = float32 cache, the baseline; 16 = bfloat16; 8, 6, 4, 2 quantised):

- ``bytes_per_token``: ``QuantizedKVCache.nbytes()`` (measured from the tensors held) over the
  tokens held at ``--context``, next to the layout's expectation (``layout_bytes_per_token``);
- ``decode_tokens_per_s`` and ``step_ms``: median decode step after a ``--context``-token
  prefill, the widths interleaved (order rotated every round), each round on a fork of the same
  prefilled cache. Timing runs the demo GPT's shape with **untrained (random) weights**: the
  work per step does not depend on the weights;
- ``dequant_gbps``: compressed bytes per second of ``keys_values`` over a filled cache (median
  of ``--repeats``, widths interleaved), next to ``copy_gbps``, a plain ``copy_`` of the
  dequantised size on the same machine (the floor, best of ``--repeats``), and the numpy
  unpack path ``policies.measure_dequantize_throughput``;
- cost model: ``kv_decompression_cost_s(compressed bytes, dequantize_bytes_per_s=dequant
  throughput)`` per decode step against the measured added step time (step - float32 step);
  ``model_error`` = (predicted - measured) / measured, reported whatever it is (target 25%);
- quality: KL(unquantised || cached) of next-token distributions and the perplexity ratio on
  held-out generated text, teacher-forced through the cache, with a small GPT trained briefly
  (``tests/tuner/kv_model.py``; weights cached in the temp dir).

Writes bench/results/kv.json.

    python bench/kv.py                      # defaults: about 1-3 minutes on 2 loaded cores
    python bench/kv.py --context 1024 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from policies import kv_decompression_cost_s, measure_dequantize_throughput  # noqa: E402
from tests.tuner.kv_model import held_out_windows, trained_gpt  # noqa: E402
from tuner.kv_cache import QUANTIZED_BITS, QuantizedKVCache, layout_bytes_per_token  # noqa: E402
from tuner.kv_decode import cache_for, decode_step, kv_quality  # noqa: E402
from workloads.gpt import GPT, GPTConfig  # noqa: E402

WIDTHS = (32, 16, 8, 6, 4, 2)
TARGET_MODEL_ERROR = 0.25


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _compressed_bytes(cache: QuantizedKVCache) -> int:
    """Bytes of the stored (non-residual) part: what a dequantising read has to unpack."""
    residual = cache.tokens_by_bits().get("residual", 0)
    return cache.nbytes() - residual * cache.batch * cache.n_heads * cache.head_dim * 2 \
        * torch.finfo(cache.dtype).bits // 8


def _decode_rounds(model: GPT, prefilled: dict[int, QuantizedKVCache], args: argparse.Namespace,
                   device: torch.device) -> dict[int, dict[str, float]]:
    step_s: dict[int, list[float]] = {w: [] for w in WIDTHS}
    compressed: dict[int, list[int]] = {w: [] for w in WIDTHS}
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (args.batch, args.steps), generator=g).to(device)
    for r in range(args.rounds):
        order = WIDTHS[r % len(WIDTHS):] + WIDTHS[:r % len(WIDTHS)]
        for width in order:
            cache = prefilled[width].fork()
            for i in range(args.steps):
                compressed[width].append(_compressed_bytes(cache))
                _sync(device)
                start = time.perf_counter()
                decode_step(model, cache, tokens[:, i:i + 1])
                _sync(device)
                step_s[width].append(time.perf_counter() - start)
    return {w: {"step_s": statistics.median(step_s[w]),
                "compressed_bytes_per_step": statistics.fmean(compressed[w])} for w in WIDTHS}


def _dequant_throughput(caches: dict[int, QuantizedKVCache], repeats: int,
                        device: torch.device) -> dict[int, tuple[float, float]]:
    """Per width: (compressed bytes/s, dequantised bytes/s) of reading every layer; widths
    interleaved, median of ``repeats`` (the median, like the decode steps', so the model is fed
    what the steps see on a loaded box)."""
    times: dict[int, list[float]] = {w: [] for w in caches}
    out_bytes: dict[int, int] = {}
    for _ in range(repeats):
        for width, cache in caches.items():
            _sync(device)
            start = time.perf_counter()
            out = [cache.keys_values(layer) for layer in range(cache.n_layers)]
            _sync(device)
            times[width].append(time.perf_counter() - start)
            out_bytes[width] = sum(t.numel() * t.element_size() for kv in out for t in kv)
    result = {}
    for width, cache in caches.items():
        median_s = statistics.median(times[width])
        result[width] = (_compressed_bytes(cache) / median_s, out_bytes[width] / median_s)
    return result


def _copy_gbps(n_bytes: int, repeats: int, device: torch.device) -> float:
    src = torch.ones(n_bytes // 4, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return n_bytes / best / 1e9


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=512, help="tokens prefilled before timing")
    p.add_argument("--steps", type=int, default=24, help="decode steps timed per width/round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=15, help="dequantise/copy micro-benchmark")
    p.add_argument("--group-size", type=int, default=16)
    p.add_argument("--residual-tokens", type=int, default=16)
    p.add_argument("--quality-seqs", type=int, default=4)
    p.add_argument("--quality-len", type=int, default=128)
    p.add_argument("--train-steps", type=int, default=150)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "kv.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    cache_kwargs = {"group_size": args.group_size, "residual_tokens": args.residual_tokens}

    # -- timing: demo GPT shape, random weights --------------------------------------------
    model = GPT(GPTConfig(block_size=args.context + args.steps + 1)).to(device).eval()
    prompt = torch.randint(0, 256, (args.batch, args.context)).to(device)
    prefilled = {}
    for width in WIDTHS:
        prefilled[width] = cache_for(model, key_bits=width, value_bits=width, **cache_kwargs)
        decode_step(model, prefilled[width], prompt)
    decode = _decode_rounds(model, prefilled, args, device)
    base_step_s = decode[32]["step_s"]

    rows = []
    dequant = _dequant_throughput(prefilled, args.repeats, device)
    for width in WIDTHS:
        cache = prefilled[width]
        compressed_gbps, output_gbps = dequant[width]
        out_bytes = int(output_gbps * _compressed_bytes(cache) / compressed_gbps)
        measured_added_s = decode[width]["step_s"] - base_step_s
        row = {
            "bits": width,
            "storage": {32: "float32", 16: "bfloat16"}.get(width, f"int{width} packed"),
            "bytes_per_token": cache.nbytes() / cache.seq_len / args.batch,
            "layout_bytes_per_token": layout_bytes_per_token(
                n_layers=cache.n_layers, n_heads=cache.n_heads, head_dim=cache.head_dim,
                key_bits=width, value_bits=width, group_size=args.group_size),
            "step_ms": decode[width]["step_s"] * 1e3,
            "decode_tokens_per_s": args.batch / decode[width]["step_s"],
            "dequant_gbps": compressed_gbps / 1e9,
            "dequant_output_gbps": output_gbps / 1e9,
            "copy_gbps": _copy_gbps(max(out_bytes, 1 << 20), args.repeats, device),
            "numpy_dequant_gbps": (measure_dequantize_throughput(width, 1 << 20, 3) / 1e9
                                   if width in QUANTIZED_BITS else None),
            "measured_added_step_ms": measured_added_s * 1e3,
        }
        if width != 32:
            predicted_s = kv_decompression_cost_s(
                decode[width]["compressed_bytes_per_step"], dequantize_bytes_per_s=compressed_gbps)
            row["model_added_step_ms"] = predicted_s * 1e3
            row["model_error"] = ((predicted_s - measured_added_s) / measured_added_s
                                  if measured_added_s > 0 else None)
        rows.append(row)

    # -- quality: small GPT trained briefly, held-out text ----------------------------------
    small, held_out = trained_gpt(steps=args.train_steps)
    text = held_out_windows(held_out, n=args.quality_seqs, seq_len=args.quality_len)
    for row in rows:
        cache = cache_for(small, key_bits=row["bits"], value_bits=row["bits"], **cache_kwargs)
        quality = kv_quality(small, text, cache)
        row["kl_nats"] = quality.kl_nats
        row["perplexity_ratio"] = quality.perplexity_ratio
        row["ref_nll_nats"] = quality.ref_nll_nats

    errors = [abs(r["model_error"]) for r in rows if r.get("model_error") is not None]
    result = {
        "bench": "kv",
        "machine": {"platform": platform.platform(), "device": str(device),
                    "threads": args.threads, "torch": torch.__version__},
        "args": vars(args),
        "timing_model": "demo GPT shape (6 layers, 4 heads, head_dim 64), untrained weights",
        "quality_model": f"2-layer GPT trained {args.train_steps} steps on generated text",
        "rows": rows,
        "model_error_median_abs": statistics.median(errors) if errors else None,
        "model_error_target": TARGET_MODEL_ERROR,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    _print(rows, result)
    return result


def _print(rows: list[dict], result: dict) -> None:
    head = (f"{'bits':>4} {'B/token':>8} {'layout':>8} {'step ms':>8} {'tok/s':>7} "
            f"{'deq GB/s':>8} {'copy GB/s':>9} {'np GB/s':>7} {'added ms':>8} {'model ms':>8} "
            f"{'err':>6} {'KL nats':>9} {'ppl x':>6}")
    print(head)

    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    for r in rows:
        print(f"{r['bits']:>4} {r['bytes_per_token']:>8.0f} {r['layout_bytes_per_token']:>8.0f} "
              f"{r['step_ms']:>8.2f} {r['decode_tokens_per_s']:>7.1f} {r['dequant_gbps']:>8.2f} "
              f"{r['copy_gbps']:>9.2f} {fmt(r['numpy_dequant_gbps'], '.2f'):>7} "
              f"{r['measured_added_step_ms']:>8.2f} {fmt(r.get('model_added_step_ms'), '.2f'):>8} "
              f"{fmt(r.get('model_error'), '+.0%'):>6} {r['kl_nats']:>9.2e} "
              f"{r['perplexity_ratio']:>6.3f}")
    print(f"cost model |error| median {fmt(result['model_error_median_abs'], '.0%')} "
          f"(target <= {TARGET_MODEL_ERROR:.0%})")


if __name__ == "__main__":
    main()
