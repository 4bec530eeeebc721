"""Framework integrations: thin adapters from a framework's loop to the same in-job sessions.

Each imports its framework itself (an optional extra: ``.[hf]``, ``.[lightning]``), so neither
the sidecar nor ``tuner`` needs it: ``tuner.integrations.hf`` and ``tuner.integrations.lightning``
(callbacks that drive ``tuner.job.Session``), ``tuner.integrations.hf_kv_cache`` (the quantised
KV cache as a transformers ``Cache``, under a ``tuner.job.ServeSession``).
"""
