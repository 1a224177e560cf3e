"""GradstreamCallback in a real Lightning Trainer run (CPU, tiny module)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

# Installed by `make test` (requirements-frameworks.txt); a missing one fails, never skips.
import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from producer.adapters.lightning import GradstreamCallback
from producer.summary import LayerSummaries, summarize
from tests.producer.adapters import FakeProducer

nn = torch.nn
# Lightning 2.6 with torch 2.15 warns about torch's own pytree API; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*is deprecated")


class TinyModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(5, 12), nn.Tanh(), nn.Linear(12, 2))
        self.frozen = nn.Linear(2, 2)
        self.frozen.requires_grad_(False)
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = nn.functional.mse_loss(self.body(x), y) * 50.0
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Snapshot(pl.Callback):
    """Records the gradients at on_before_optimizer_step, and their norm after the
    optimiser step (clipped; Lightning zeroes them only at the next step)."""

    def __init__(self) -> None:
        self.expected: list[LayerSummaries] = []
        self.steps: list[int] = []
        self.clipped_norms: list[float] = []

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.steps.append(trainer.global_step)
        self.expected.append(summarize({
            n: p.grad.detach().numpy().copy()
            for n, p in pl_module.named_parameters() if p.grad is not None
        }))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        if (args[-1] + 1) % trainer.accumulate_grad_batches == 0:  # batch_idx: stepped
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            self.clipped_norms.append(float(torch.linalg.vector_norm(
                torch.cat([g.reshape(-1) for g in grads]))))


def loader() -> Any:
    gen = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randn(64, 5, generator=gen),
                                          torch.randn(64, 2, generator=gen))
    return torch.utils.data.DataLoader(data, batch_size=4)


def trainer(callbacks: list[Any], **overrides: Any) -> Any:
    kwargs: dict[str, Any] = {
        "max_steps": 3,
        "accumulate_grad_batches": 4,
        "gradient_clip_val": 0.5,
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "callbacks": callbacks,
    }
    kwargs.update(overrides)
    return pl.Trainer(**kwargs)


def test_fit_one_summary_per_optimizer_step_before_clipping() -> None:
    fake = FakeProducer()
    callback = GradstreamCallback(fake, config={"user": 1})
    snapshot = Snapshot()
    module = TinyModule()
    trainer([callback, snapshot]).fit(module, loader())
    # Each summary carries the mean of its 4 micro-batches' training_step losses (not
    # Lightning's loss divided for accumulation) and the optimiser's learning rate.
    losses = np.asarray(module.losses).reshape(3, 4).mean(axis=1)
    assert [values["loss"] for _, values, _ in fake.scalars] == pytest.approx(losses, rel=1e-6)
    assert all(values["lr"] == 0.05 for _, values, _ in fake.scalars)

    assert fake.layer_numel == {
        "body.0.weight": 60, "body.0.bias": 12, "body.2.weight": 24, "body.2.bias": 2,
        "frozen.weight": 4, "frozen.bias": 2,
    }
    framework = fake.start_kwargs["config"]["framework"]
    assert framework["name"] == "lightning" and framework["accumulate_grad_batches"] == 4
    assert fake.start_kwargs["config"]["user"] == 1
    # 3 optimiser steps of 4 micro-batches each: 3 summaries, not 12.
    assert [s for s, _ in fake.steps] == snapshot.steps == [0, 1, 2]
    for (_, got), want in zip(fake.steps, snapshot.expected, strict=True):
        assert got.names == want.names == ("body.0.weight", "body.0.bias", "body.2.weight",
                                           "body.2.bias")
        np.testing.assert_array_equal(got.numel, want.numel)
        np.testing.assert_allclose(got.sum_abs, want.sum_abs, rtol=1e-9)
        np.testing.assert_allclose(got.sum_sq, want.sum_sq, rtol=1e-9)
        np.testing.assert_array_equal(got.max_abs, want.max_abs)
    # The summaries are taken before Lightning clips to 0.5: their norm is the raw one.
    for (_, got), clipped in zip(fake.steps, snapshot.clipped_norms, strict=True):
        assert np.sqrt(got.sum_sq.sum()) > 1.0 and clipped == pytest.approx(0.5, rel=1e-4)
    assert callback.tap.skipped_without_grad == 2 * 3
    assert fake.finished == 1 and fake.closed == 0


def test_every_n_steps_and_close() -> None:
    fake = FakeProducer()
    callback = GradstreamCallback(fake, every_n_steps=2, include="body.0.*", close_producer=True)
    trainer([callback], max_steps=5, accumulate_grad_batches=1).fit(TinyModule(), loader())
    assert [s for s, _ in fake.steps] == [0, 2, 4]
    assert all(s.names == ("body.0.weight", "body.0.bias") for _, s in fake.steps)
    assert fake.finished == 1 and fake.closed == 1


def test_rank_mismatch_is_refused() -> None:
    callback = GradstreamCallback(FakeProducer(rank=1, world_size=2))
    with pytest.raises(ValueError, match="world_size is 2 but the trainer's is 1"):
        trainer([callback]).fit(TinyModule(), loader())


def test_clear_error_without_lightning() -> None:
    code = (
        "import sys; sys.modules['lightning'] = None; sys.modules['pytorch_lightning'] = None\n"
        "import producer.adapters.lightning as lt\n"
        "try:\n"
        "    lt.GradstreamCallback\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).parents[3]).stdout
    assert "pip install lightning" in out
