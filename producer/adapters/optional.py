"""Imports of the frameworks the adapters serve (torch, jax, transformers, lightning), made
when an adapter is used, never at ``import producer.adapters``: a missing one raises an
ImportError naming the pip package to install."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any


def import_framework(module: str, framework: str, install: str) -> ModuleType:
    """Import ``module`` for the adapter of ``framework``.

    Args:
        module: the module to import (``"torch"``, ``"jax"``).
        framework: the framework's name in the error message (``"PyTorch"``).
        install: how to install it, e.g. ``"pip install torch"``.

    Returns:
        The module.

    Raises:
        ImportError: the module cannot be imported; the message names the adapter and
            ``install``.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"gradstream's {framework} adapter needs {framework}: {install}"
        ) from exc


def import_torch() -> ModuleType:
    """``torch``, or an ImportError naming the pip package."""
    return import_framework("torch", "PyTorch",
                            "pip install torch (or pip install 'gradstream[torch]')")


def import_jax() -> ModuleType:
    """``jax``, or an ImportError naming the pip package."""
    return import_framework("jax", "JAX", "pip install 'jax[cpu]' (or jax[cuda12]), "
                            "or pip install 'gradstream[jax]'")


def lazy_class(
    module_globals: dict[str, Any], name: str, build: Callable[[], type]
) -> Callable[[str], Any]:
    """A module ``__getattr__`` (PEP 562) that builds the class ``name`` on first access,
    for classes deriving from a framework's class (importing the module does not import
    the framework).

    Args:
        module_globals: the module's ``globals()``; the class is stored there once built.
        name: the class's name.
        build: makes the class (imports the framework; raises its ImportError).

    Returns:
        The ``__getattr__`` function; it raises AttributeError for any other name.
    """
    module = module_globals["__name__"]

    def module_getattr(attr: str) -> Any:
        if attr != name:
            raise AttributeError(f"module {module!r} has no attribute {attr!r}")
        cls = build()
        cls.__module__ = module
        cls.__qualname__ = name
        module_globals[name] = cls
        return cls

    module_getattr.__doc__ = (f"Create ``{name}`` on first access (imports its framework then).\n\n"
                           "Raises:\n    ImportError: the framework is missing or too old.\n"
                           "    AttributeError: any other name.")
    return module_getattr
