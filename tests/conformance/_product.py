"""What the conformance suites hold to a contract: the product's classes, not a test's."""

from __future__ import annotations


def product_subclasses(cls: type) -> set[type]:
    """Every subclass of ``cls``, at any depth, except a test's own stand-ins."""
    found: set[type] = set()
    children: list[type] = cls.__subclasses__()
    for child in children:
        found |= {child, *product_subclasses(child)}
    return {c for c in found if not c.__module__.startswith("tests.")}
