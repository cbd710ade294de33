"""Soak: 600 optimisation steps on the digits (2 x 2 patch tokens) for every registered attention with the full
training loss (cross-entropy + KL / n + KSVD penalty), and not one non-finite loss, gradient or parameter.

Every step checks the loss and the pre-clipping global gradient norm (one reduction each); every 100 steps and at the
end every parameter is checked, and the learned singular values must stay positive. A tiny model (width 16, one
block, 2 heads, rank / inducing sets 4-8, batch 32) keeps the whole soak near a minute on 2 cores.
"""

from __future__ import annotations

import math
import time

import pytest
import torch

from gpattn.attention import attention_arguments, attention_names
from gpattn.data import load_digits_splits
from gpattn.mlls import AttentionELBO
from gpattn.models import Transformer

STEPS, BATCH, CHECK_EVERY = 600, 32, 100
SIZES = {"num_inducing": 4}


@pytest.fixture(scope="module")
def digits():
    return load_digits_splits(seed=0).train


def _learned_singular_values(model: Transformer) -> list[torch.Tensor]:
    values = []
    for layer in model.attention_layers():
        features = getattr(layer, "features", None)
        if features is not None and hasattr(features, "raw_singular_values"):
            values.append(features.singular_values)
    return values


def _non_finite(model: Transformer) -> list[str]:
    return [name for name, parameter in model.named_parameters() if not torch.isfinite(parameter).all()]


@pytest.mark.slow
@pytest.mark.parametrize("name", attention_names())
def test_soak_600_steps_on_digits_stays_finite(digits, name):
    torch.manual_seed(0)
    sizes = {key: value for key, value in SIZES.items() if key in attention_arguments(name)}
    model = Transformer(
        digits.num_classes,
        embed_dim=16,
        depth=1,
        num_heads=2,
        attention=name,
        input="patches",
        image_size=8,
        patch_size=2,
        in_channels=1,
        mlp_ratio=1.0,
        **sizes,
    )
    loss_fn = AttentionELBO(model, num_data=len(digits), beta=1.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.01)
    generator = torch.Generator().manual_seed(0)
    model.train()
    started, cpu_started = time.perf_counter(), time.process_time()
    recent = []
    for step in range(1, STEPS + 1):
        index = torch.randint(0, len(digits), (BATCH,), generator=generator)
        loss = loss_fn(model(digits.images[index]), digits.labels[index])
        assert math.isfinite(loss.item()), f"{name}: non-finite loss {loss.item()} at step {step}"
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the norm before clipping
        assert torch.isfinite(grad_norm), f"{name}: non-finite gradient norm at step {step}"
        optimizer.step()
        recent = (recent + [loss.item()])[-100:]
        if step % CHECK_EVERY == 0 or step == STEPS:
            assert not _non_finite(model), f"{name}: non-finite parameters {_non_finite(model)} after step {step}"
            for values in _learned_singular_values(model):
                assert (values > 0).all() and torch.isfinite(values.reciprocal()).all(), f"{name}: Lambda at {step}"
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    largest = max(parameter.detach().abs().max().item() for parameter in model.parameters())
    final_loss = sum(recent) / len(recent)
    print(
        f"\nsoak {name}: {STEPS} steps in {seconds:.1f} s ({cpu_seconds:.1f} s CPU), max |param| {largest:.3g}, "
        f"final loss {final_loss:.4f} (mean of the last 100 steps)"
    )
    assert final_loss < math.log(digits.num_classes)  # it learned something (chance: log 8 = 2.08)
