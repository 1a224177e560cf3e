"""GradstreamCallback in a real Hugging Face Trainer run (CPU, tiny model)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

# Installed by `make test` (requirements-frameworks.txt); a missing one fails, never skips.
import accelerate  # noqa: F401
import numpy as np
import pytest
import torch
import transformers

from producer.adapters.hf import GradstreamCallback
from producer.summary import LayerSummaries, summarize
from tests.producer.adapters import FakeProducer

nn = torch.nn


class TinyRegressor(nn.Module):
    """A model the Trainer accepts: forward(**batch) -> {"loss": ...}."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(5, 12), nn.Tanh(), nn.Linear(12, 2))
        self.unused = nn.Linear(2, 2)  # never in the graph: skipped every step
        self.losses: list[float] = []

    def forward(self, x: Any, labels: Any) -> dict[str, Any]:
        loss = nn.functional.mse_loss(self.body(x), labels) * 50.0
        self.losses.append(float(loss.detach()))
        return {"loss": loss}


class Rows(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        gen = torch.Generator().manual_seed(3)
        self.x = torch.randn(n, 5, generator=gen)
        self.y = torch.randn(n, 2, generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": self.x[i], "labels": self.y[i]}


class Snapshot(transformers.TrainerCallback):
    """Records the gradients the optimiser is about to use, as NumPy arrays."""

    def __init__(self) -> None:
        self.expected: list[LayerSummaries] = []
        self.steps: list[int] = []
        self.lrs: list[float] = []

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = kwargs["model"]
        self.steps.append(state.global_step)
        self.lrs.append(kwargs["optimizer"].param_groups[0]["lr"])
        self.expected.append(summarize({
            n: p.grad.detach().numpy().copy()
            for n, p in model.named_parameters() if p.grad is not None
        }))


def trainer_args(tmp_path: Path, **overrides: Any) -> Any:
    kwargs: dict[str, Any] = {
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 4,
        "max_steps": 3,
        "learning_rate": 0.05,
        "report_to": [],
        "save_strategy": "no",
        "logging_strategy": "no",
        "use_cpu": True,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }
    kwargs.update(overrides)
    return transformers.TrainingArguments(**kwargs)


def test_trainer_run_one_summary_per_optimizer_step(tmp_path: Path) -> None:
    fake = FakeProducer()
    callback = GradstreamCallback(fake, exclude="body.2.bias", config={"user": 1})
    snapshot = Snapshot()
    model = TinyRegressor()
    trainer = transformers.Trainer(
        model=model, args=trainer_args(tmp_path), train_dataset=Rows(64),
        callbacks=[callback, snapshot],
    )
    trainer.train()
    # Each summary carries the mean loss of its 4 micro-batches and the step's learning
    # rate (the Trainer's linear schedule changes it every step).
    losses = np.asarray(model.losses).reshape(3, 4).mean(axis=1)
    assert len(fake.scalars) == 3
    for (step, values, _), loss, lr in zip(fake.scalars, losses, snapshot.lrs, strict=True):
        assert values["loss"] == pytest.approx(loss, rel=1e-6)
        assert values["lr"] == lr
        # timed from the previous optimiser step: the first step has neither time
        assert ("step_time_s" in values) == ("compute_time_s" in values) == (step > 0)
    assert len(set(snapshot.lrs)) == 3

    assert fake.layer_numel == {
        "body.0.weight": 60, "body.0.bias": 12, "body.2.weight": 24,
        "unused.weight": 4, "unused.bias": 2,
    }
    config = fake.start_kwargs["config"]
    assert config["user"] == 1 and config["framework"]["name"] == "transformers"
    assert config["framework"]["gradient_accumulation_steps"] == 4
    # 3 optimiser steps of 4 micro-batches each: 3 summaries, not 12.
    assert [s for s, _ in fake.steps] == snapshot.steps == [0, 1, 2]
    for (_, got), want in zip(fake.steps, snapshot.expected, strict=True):
        keep = [i for i, n in enumerate(want.names) if n != "body.2.bias"]
        assert got.names == tuple(want.names[i] for i in keep)
        np.testing.assert_array_equal(got.numel, want.numel[keep])
        np.testing.assert_allclose(got.sum_abs, want.sum_abs[keep], rtol=1e-9)
        np.testing.assert_allclose(got.sum_sq, want.sum_sq[keep], rtol=1e-9)
        np.testing.assert_array_equal(got.max_abs, want.max_abs[keep])
    assert callback.tap.skipped_without_grad == 2 * 3
    assert fake.finished == 1 and fake.closed == 0


def test_every_n_steps_and_close(tmp_path: Path) -> None:
    fake = FakeProducer()
    callback = GradstreamCallback(fake, every_n_steps=2, close_producer=True)
    trainer = transformers.Trainer(
        model=TinyRegressor(), args=trainer_args(tmp_path, gradient_accumulation_steps=1,
                                                 max_steps=5),
        train_dataset=Rows(64), callbacks=[callback],
    )
    trainer.train()
    assert [s for s, _ in fake.steps] == [0, 2, 4]
    assert fake.finished == 1 and fake.closed == 1


def test_world_size_mismatch_is_refused(tmp_path: Path) -> None:
    trainer = transformers.Trainer(
        model=TinyRegressor(), args=trainer_args(tmp_path), train_dataset=Rows(16),
        callbacks=[GradstreamCallback(FakeProducer(rank=0, world_size=2))],
    )
    with pytest.raises(ValueError, match="world_size is 2 but the trainer's is 1"):
        trainer.train()


def test_invalid_every_n_steps() -> None:
    with pytest.raises(ValueError, match=">= 1"):
        GradstreamCallback(FakeProducer(), every_n_steps=0)


def test_clear_error_without_transformers() -> None:
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import producer.adapters.hf as hf\n"
        "try:\n"
        "    hf.GradstreamCallback\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).parents[3]).stdout
    assert "pip install" in out and "transformers" in out
