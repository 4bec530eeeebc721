"""Deciding what is wrong: cost models, detectors and the engine that runs them."""
