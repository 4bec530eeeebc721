"""Lazy public names for a package face, each name written once.

A face lists its exports as typed re-exports (``from collectors._store import TimeSeriesStore
as TimeSeriesStore``) under ``if TYPE_CHECKING:``, so mypy sees the real types at every import
through the face. That block does not run; `lazy_exports` reads the same lines from the face's
source instead and loads a name's module on first use. So ``import collectors`` or
``import tuner`` stays cheap (no torch, pandas or server stack) and the API has one spelling.
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Callable
from typing import Any


def _reexport(node: ast.stmt) -> dict[str, str] | None:
    """Name -> module if `node` is ``from M import N as N, ...`` (PEP 484's re-export form)."""
    if (isinstance(node, ast.ImportFrom) and not node.level and node.module is not None
            and all(alias.asname == alias.name for alias in node.names)):
        return dict.fromkeys((alias.name for alias in node.names), node.module)
    return None


def exported_modules(source: str, filename: str) -> dict[str, str]:
    """Name -> module of a face's exports: its ``from M import N as N`` lines, at top level
    (loaded with the face) or under ``if TYPE_CHECKING:`` (loaded on first use).

    The block may hold nothing else: a line there that mypy would read but the map would miss
    is refused, so the types and the runtime names cannot drift apart.
    """
    exports: dict[str, str] = {}
    for node in ast.parse(source, filename).body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) \
                and node.test.id == "TYPE_CHECKING":
            for line in node.body:
                found = _reexport(line)
                if found is None:
                    raise ImportError(f"{filename}:{line.lineno}: a face's TYPE_CHECKING block "
                                      "may only hold absolute `from M import N as N` lines")
                exports.update(found)
        else:
            exports.update(_reexport(node) or {})
    return exports


def lazy_exports(namespace: dict[str, Any]
                 ) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """`__all__`, `__getattr__` and `__dir__` for the face whose globals are `namespace`."""
    package, spec = namespace["__name__"], namespace["__spec__"]
    source = spec.loader.get_source(package)
    if source is None:
        raise ImportError(f"{package}: its exports are read from its source, which is missing")
    exports = exported_modules(source, spec.origin)
    names = sorted(exports)

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return names

    return names, __getattr__, __dir__
