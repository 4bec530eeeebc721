"""Revisions of our state tables, oldest first; each is frozen once released."""
