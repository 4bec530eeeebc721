"""The lazy package faces: the names mypy types are exactly the names the runtime hands out.

A lazy face (``collectors``, ``tuner``, ``tuner.job``) lists each export once, as a typed
import under ``if TYPE_CHECKING:`` that only mypy runs; ``lazy_exports`` turns the same lines
into the map it loads names from. These tests run that block for real and hold the face to it.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from types import ModuleType

import pytest

from collectors._lazy import exported_modules

# The names each face exports outside its TYPE_CHECKING block (loaded with the face).
EAGER = {"collectors": {"lazy_exports"}, "tuner": set(), "tuner.job": set()}


def typed_names(face: ModuleType) -> dict[str, object]:
    """Run the face's ``if TYPE_CHECKING:`` block as mypy reads it; the names it binds."""
    block = next(node for node in ast.parse(inspect.getsource(face)).body
                 if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    namespace: dict[str, object] = {}
    exec(compile(ast.Module(body=block.body, type_ignores=[]), str(face.__file__), "exec"),
         namespace)
    del namespace["__builtins__"]
    return namespace


@pytest.mark.parametrize("package", sorted(EAGER))
def test_a_lazy_face_exports_what_mypy_types(package: str) -> None:
    face = importlib.import_module(package)
    typed = typed_names(face)
    assert set(face.__all__) == set(typed) | EAGER[package]
    assert dir(face) == sorted(face.__all__)
    for name, value in typed.items():
        assert getattr(face, name) is value, name


def test_a_typed_import_the_runtime_would_miss_is_refused() -> None:
    source = ("from typing import TYPE_CHECKING\n"
              "if TYPE_CHECKING:\n"
              "    from collectors._store import TimeSeriesStore\n")
    with pytest.raises(ImportError, match=r"face\.py:3"):
        exported_modules(source, "face.py")


def test_only_re_exports_are_exported() -> None:
    source = ("from typing import TYPE_CHECKING\n"
              "from pkg._a import helper\n"
              "from pkg._a import shown as shown\n"
              "if TYPE_CHECKING:\n"
              "    from pkg._b import Lazy as Lazy, Other as Other\n")
    assert exported_modules(source, "face.py") == {"shown": "pkg._a", "Lazy": "pkg._b",
                                                   "Other": "pkg._b"}
