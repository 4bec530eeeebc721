"""The GPU truth: measurements that only a real GPU can give, run by ``bench/gpu_truth.sh``.

Each module is one part (``python -m bench.gpu_truth.<part> --out DIR``) writing
``DIR/<part>.json``; ``_record`` gives every JSON the same header (device, driver, torch, time)
and the same shape for targets (``met``) and for a measurement that failed (``errors``).
"""
