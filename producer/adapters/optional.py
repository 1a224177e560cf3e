"""Imports of the frameworks the adapters serve (torch, jax), made when an adapter is used,
never at ``import producer.adapters``: a missing one raises an ImportError naming the pip
package to install."""

from __future__ import annotations

import importlib
from types import ModuleType


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
