"""Framework integrations: callbacks that drive ``tuner.job.Session`` from a framework's loop.

Each imports its framework itself (an optional extra: ``.[hf]``, ``.[lightning]``), so neither
the sidecar nor ``tuner`` needs it: ``tuner.integrations.hf``, ``tuner.integrations.lightning``.
"""
