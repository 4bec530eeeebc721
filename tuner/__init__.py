"""Changing things: knobs, search, approvals, rollout, the in-job client, sidecar and CLI."""
