"""Importing the SDK and its adapters must not load any deep-learning framework."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

FRAMEWORKS = ("torch", "jax", "jaxlib", "transformers", "accelerate", "lightning",
              "pytorch_lightning")


def test_import_producer_and_adapters_loads_no_framework() -> None:
    code = (
        "import sys\n"
        "import producer, producer.adapters\n"
        "import producer.adapters.naming, producer.adapters.torch, producer.adapters.jax\n"
        "import producer.adapters.hf, producer.adapters.lightning\n"
        "from producer.adapters import GradientTap, flatten_gradients, normalize_name\n"
        f"print(sorted(m for m in {FRAMEWORKS!r} if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, cwd=Path(__file__).parents[3])
    assert result.stdout.strip() == "[]", result.stdout


def test_unknown_lazy_attribute_is_an_attribute_error() -> None:
    import producer.adapters.hf as hf
    import producer.adapters.lightning as lt

    for module in (hf, lt):
        assert not hasattr(module, "NoSuchThing")
