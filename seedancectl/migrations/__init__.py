"""Alembic migrations of our state tables (``seedancectl._state_schema`` runs them)."""
