"""What ``compare_precisions`` measures on models that are not the example's: attention through
``nn.MultiheadAttention`` (its projections run functionally, never in FP8) and gradient accumulation (a step is an
optimizer step, not a micro-batch)."""

from __future__ import annotations

import time

import lightning as L
import pytest
import torch
from torch import nn

from lightning_fp8 import compare


class _Attention(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(32, 64)
        self.attn = nn.MultiheadAttention(64, 4, batch_first=True)
        self.head = nn.Linear(64, 16)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.inp(x)
        h, _ = self.attn(h, key=h, value=h, need_weights=False)
        return nn.functional.mse_loss(self.head(h).float(), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _data(n: int = 64, batch_size: int = 4) -> torch.utils.data.DataLoader:
    dataset = torch.utils.data.TensorDataset(torch.randn(n, 16, 32), torch.randn(n, 16, 16))
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size)


def test_multihead_attention_projections_count_as_high_precision_flops():
    result = compare.compare_precisions(_Attention, _data(), recipes=["tensorwise"], steps=2, warmup=1)
    rows = 4 * 16
    fp8 = 32 * 64 + 64 * 16  # inp, head
    high = 3 * 64 * 64 + 64 * 64  # the attention's q, k, v and output projections (functional, not FP8)
    run = result.runs[1]
    assert list(run.skipped_layers) == ["attn.out_proj"]
    assert run.linear_flops_per_step == 3 * 2 * rows * (fp8 + high)
    assert run.fp8_flops_share == pytest.approx(fp8 / (fp8 + high))
    assert "| 15.8% |" in result.to_markdown()


class _SlowStep(torch.optim.SGD):
    def step(self, closure=None):
        out = super().step(closure)
        time.sleep(0.2)
        return out


class _Accumulating(_Attention):
    def configure_optimizers(self):
        return _SlowStep(self.parameters(), lr=0.01)


def test_gradient_accumulation_times_whole_optimizer_steps():
    accumulate = 4
    result = compare.compare_precisions(
        _Accumulating, _data(), recipes=["tensorwise"], steps=3, warmup=1,
        trainer_kwargs={"accumulate_grad_batches": accumulate},
    )  # fmt: skip
    for run in result.runs:
        # one entry per optimizer step, each holding its optimizer step (0.2 s of sleep)
        assert len(run.step_times_s) == len(run.losses) == 3
        assert all(t >= 0.2 for t in run.step_times_s), run.step_times_s
        assert run.samples_per_s == pytest.approx(accumulate * 4 / run.step_time_s)
        assert run.tokens_per_s is None  # float inputs
        assert len(run.batch_fingerprints) == 3 * accumulate
    assert result.same_data


def test_config_keeps_gradient_accumulation():
    from jsonargparse import Namespace

    config = Namespace(trainer=Namespace(accumulate_grad_batches=4, max_epochs=3, plugins=None, accelerator="cpu"))
    trainer_kwargs, _ = compare._from_config(config)
    assert trainer_kwargs == {"accelerator": "cpu", "accumulate_grad_batches": 4}


def test_bf16_baseline_autocasts_on_cuda_for_an_accelerator_instance(monkeypatch):
    """Trainer(accelerator=CUDAAccelerator()) runs on CUDA: the bf16-mixed baseline must autocast there, not on the
    CPU (which would leave the GPU baseline in float32 and make FP8 look faster)."""
    from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert compare._autocast_device({"accelerator": CUDAAccelerator()}) == "cuda"
    assert compare._autocast_device({"accelerator": CPUAccelerator()}) == "cpu"
    assert compare._autocast_device({"accelerator": "gpu"}) == "cuda"
    assert compare._autocast_device({"accelerator": "cpu"}) == "cpu"


def test_runs_that_start_from_different_weights_are_reported_or_refused():
    model = _Attention()
    with pytest.raises(ValueError, match="module_factory returned the model of an earlier run"):
        compare.compare_precisions(lambda: model, _data(), recipes=["tensorwise"], steps=2, warmup=1)

    draws = iter(range(100))

    def unseeded():  # a factory whose weights do not follow the seed
        torch.manual_seed(next(draws))
        return _Attention()

    result = compare.compare_precisions(unseeded, _data(), recipes=["tensorwise"], steps=2, warmup=1)
    assert not result.same_weights and result.same_data
    assert "**the runs started from different weights.**" in result.to_markdown()
    assert compare.PrecisionComparison.from_dict(result.to_dict()).same_weights is False
    same = compare.compare_precisions(_Attention, _data(), recipes=["tensorwise"], steps=2, warmup=1)
    assert same.same_weights and "different weights" not in same.to_markdown()


def test_each_run_starts_after_the_previous_model_is_freed():
    """Trainer, strategy, model and callbacks reference each other: without a collection the previous run's model and
    optimizer state would still be allocated (on CUDA: in the next run's peak memory)."""
    import weakref

    made: list[weakref.ref] = []

    def factory():
        assert all(ref() is None for ref in made), "the previous run's model is still alive"
        model = _Attention()
        made.append(weakref.ref(model))
        return model

    compare.compare_precisions(factory, _data(), recipes=["tensorwise", "delayed"], steps=2, warmup=1)
    assert len(made) == 3
