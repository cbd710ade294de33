"""Tests of :func:`~gpattn.models.mc_dropout`: dropout masks drawn in eval mode inside the block only, modes restored,
reproducible under a seed, the expectation of a dropped-out input, and clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpattn.models import Transformer, dropout_modules, mc_dropout, monte_carlo_logits


def small_model(dropout: float = 0.2, attention: str = "softmax") -> Transformer:
    torch.manual_seed(0)
    extra = {"num_inducing": 3} if attention == "kep_svgp" else {}
    return Transformer(
        3, embed_dim=16, depth=2, num_heads=2, attention=attention, vocab_size=7, dropout=dropout, **extra
    ).double()


TOKENS = torch.randint(0, 7, (5, 6), generator=torch.Generator().manual_seed(1))


def test_samples_differ_inside_and_not_outside() -> None:
    model = small_model().eval()
    outside = [model(TOKENS) for _ in range(2)]
    torch.testing.assert_close(outside[0], outside[1], rtol=0, atol=0)
    with torch.no_grad(), mc_dropout(model):
        inside = [model(TOKENS) for _ in range(2)]
    assert (inside[0] - inside[1]).abs().max() > 1e-3
    after = model(TOKENS)
    torch.testing.assert_close(after, outside[0], rtol=0, atol=0)  # off again: the eval-mode prediction


def test_modes_are_restored_and_only_dropout_switched() -> None:
    model = small_model(attention="kep_svgp")
    model.eval()
    model.blocks[0].mlp_norm.train(True)  # a module the user left in training mode keeps it
    before = {name: module.training for name, module in model.named_modules()}
    with mc_dropout(model):
        for name, module in model.named_modules():
            is_dropout = module in dropout_modules(model)
            assert module.training == (is_dropout or before[name]), name
        # the GP attention layer does not sample: MC dropout and GP sampling are separate switches
        assert not model.blocks[-1].attention.sampling
    assert {name: module.training for name, module in model.named_modules()} == before
    with pytest.raises(RuntimeError, match="boom"), mc_dropout(model):
        raise RuntimeError("boom")
    assert {name: module.training for name, module in model.named_modules()} == before


def test_reproducible_under_a_seed() -> None:
    model = small_model().eval()
    runs = []
    for _ in range(2):
        torch.manual_seed(42)
        with torch.no_grad(), mc_dropout(model):
            runs.append(torch.stack([model(TOKENS) for _ in range(3)]))
    torch.testing.assert_close(runs[0], runs[1], rtol=0, atol=0)


def test_dropout_is_unbiased() -> None:
    # inverted dropout: each unit is 0 with probability q and x / (1 - q) otherwise, so E = x and the fraction of
    # zeros is q; 200000 draws put both within a few standard errors (sd of the zero fraction 0.001)
    layer = torch.nn.Sequential(torch.nn.Dropout(0.25)).eval()
    x = torch.full((200000,), 3.0, dtype=torch.float64)
    torch.manual_seed(0)
    with mc_dropout(layer):
        out = layer(x)
    assert set(out.unique().tolist()) == {0.0, 4.0}
    assert abs((out == 0).double().mean().item() - 0.25) < 0.005
    assert abs(out.mean().item() - 3.0) < 0.03


def test_dropout_modules_lists_positive_rates() -> None:
    model = torch.nn.Sequential(torch.nn.Dropout(0.0), torch.nn.Linear(2, 2), torch.nn.Dropout2d(0.1))
    assert dropout_modules(model) == [model[2]]


def test_errors_and_disabled_block() -> None:
    model = small_model(dropout=0.0).eval()
    with pytest.raises(ValueError, match="no dropout"), mc_dropout(model):
        pass
    with mc_dropout(model, enabled=False):  # a no-op, whatever the model holds
        torch.testing.assert_close(model(TOKENS), model(TOKENS), rtol=0, atol=0)
    with pytest.raises(TypeError, match="torch.nn.Module"), mc_dropout("model"):
        pass


def test_torch_transformer_layers_sample_their_dropout_without_gradients() -> None:
    # an eval-mode torch.nn.TransformerEncoderLayer (batch_first) under no_grad ran torch's fused fast path, which never
    # calls its dropout modules: every MC-dropout pass was identical (and monte_carlo_logits gave no spread). Reference:
    # the same seed through the layer's composite path in training mode (the fast path off: its outputs are laid out
    # differently, so the same seed drops other entries), its attention weights (a float rate, not a dropout module,
    # so not MC dropout) in eval mode
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.3, batch_first=True, dtype=torch.float64)
    inputs = torch.randn(5, 6, 8, dtype=torch.float64)
    layer.train()
    layer.self_attn.eval()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        torch.manual_seed(7)
        with torch.no_grad():
            reference = torch.stack([layer(inputs) for _ in range(2)])
    finally:
        torch.backends.mha.set_fastpath_enabled(True)
    layer.eval()
    torch.manual_seed(7)
    with torch.no_grad(), mc_dropout(layer):
        samples = torch.stack([layer(inputs) for _ in range(2)])
    assert torch.backends.mha.get_fastpath_enabled()  # restored
    assert (samples[0] - samples[1]).abs().max() > 1e-3
    torch.testing.assert_close(samples, reference, rtol=1e-12, atol=1e-12)
    torch.manual_seed(7)
    logits = monte_carlo_logits(torch.nn.Sequential(layer, torch.nn.Flatten()), inputs, num_samples=2, mc_dropout=True)
    torch.testing.assert_close(logits, reference.flatten(2), rtol=1e-12, atol=1e-12)
    assert not layer.training and not layer.dropout1.training


def test_enabled_is_a_flag_not_a_truthy_value() -> None:
    # mc_dropout(model, enabled="no") switched dropout on (a non-empty string is true)
    model = small_model(dropout=0.3).eval()
    with (
        pytest.raises(TypeError, match="mc_dropout: expected enabled to be True or False, got 'no'"),
        mc_dropout(model, enabled="no"),
    ):
        pass
    assert not any(module.training for module in model.modules())
    with mc_dropout(model, enabled=np.False_):  # NumPy's bools are flags: dropout stays off
        torch.testing.assert_close(model(TOKENS), model(TOKENS), rtol=0, atol=0)
