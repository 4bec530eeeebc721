"""Demo jobs that use the project the way a user would (not imported by the packages)."""
