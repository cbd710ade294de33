"""Tests of :func:`~gpattn.models.monte_carlo_logits`: it equals :func:`~gpattn.models.predict_probabilities` before the
softmax average, runs deterministic models once, batches without changing results, samples dropout on request."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpattn.models import Transformer, monte_carlo_logits, predict_probabilities

TOKENS = torch.randint(1, 7, (6, 5), generator=torch.Generator().manual_seed(1))
MASK = torch.arange(5) < torch.tensor([5, 2, 4, 1, 5, 3])[:, None]


def small_model(attention: str, dropout: float = 0.0) -> Transformer:
    torch.manual_seed(0)
    extra = {"num_inducing": 3} if attention in ("kep_svgp", "sgpa") else {}
    return Transformer(
        3, embed_dim=16, depth=2, num_heads=2, attention=attention, vocab_size=7, dropout=dropout, **extra
    ).double()


@pytest.mark.parametrize("attention", ["kep_svgp", "sgpa"])
def test_softmax_average_is_predict_probabilities(attention: str) -> None:
    model = small_model(attention).train()
    torch.manual_seed(3)
    expected = predict_probabilities(model, TOKENS, mask=MASK, num_samples=5)
    torch.manual_seed(3)
    logits = monte_carlo_logits(model, TOKENS, mask=MASK, num_samples=5)
    assert logits.shape == (5, 6, 3)
    assert (logits[0] - logits[1]).abs().max() > 1e-6  # GP samples
    torch.testing.assert_close(logits.softmax(-1).mean(0), expected, rtol=1e-12, atol=1e-12)
    assert model.training  # the mode is restored


def test_deterministic_model_runs_once_and_batches_agree() -> None:
    model = small_model("softmax").eval()
    logits = monte_carlo_logits(model, TOKENS, mask=MASK, num_samples=7)
    assert logits.shape == (1, 6, 3)
    torch.testing.assert_close(logits[0], model(TOKENS, mask=MASK), rtol=0, atol=0)
    batched = monte_carlo_logits(model, TOKENS, mask=MASK, num_samples=7, batch_size=4)  # batches of 4 and 2
    torch.testing.assert_close(batched, logits, rtol=1e-12, atol=1e-12)


def test_mc_dropout_samples() -> None:
    model = small_model("softmax", dropout=0.3).eval()
    torch.manual_seed(0)
    logits = monte_carlo_logits(model, TOKENS, num_samples=4, mc_dropout=True, batch_size=5)
    assert logits.shape == (4, 6, 3)
    assert (logits[0] - logits[1]).abs().max() > 1e-3
    torch.manual_seed(0)
    torch.testing.assert_close(
        monte_carlo_logits(model, TOKENS, num_samples=4, mc_dropout=True, batch_size=5), logits, rtol=0, atol=0
    )
    assert not any(module.training for module in model.modules())  # dropout off again
    with pytest.raises(ValueError, match="no dropout"):
        monte_carlo_logits(small_model("softmax"), TOKENS, mc_dropout=True)


@pytest.mark.parametrize("attention", ["softmax", "kep_svgp"])
def test_predict_probabilities_with_mc_dropout_is_the_dropout_samples_average(attention: str) -> None:
    """``predict_probabilities(mc_dropout=True)``: the softmax average of the MC-dropout logit samples (a
    deterministic attention sampled too), the same draws in the same order; dropout off again afterwards."""
    model = small_model(attention, dropout=0.3).eval()
    torch.manual_seed(4)
    expected = monte_carlo_logits(model, TOKENS, mask=MASK, num_samples=4, mc_dropout=True).softmax(-1).mean(0)
    torch.manual_seed(4)
    got = predict_probabilities(model, TOKENS, mask=MASK, num_samples=4, mc_dropout=True)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert (got - predict_probabilities(model, TOKENS, mask=MASK, num_samples=4)).abs().max() > 1e-3
    assert not any(module.training for module in model.modules())
    with pytest.raises(ValueError, match="no dropout"):
        predict_probabilities(small_model("softmax"), TOKENS, mc_dropout=True)
    with pytest.raises(ValueError, match="mc_dropout to be True or False"):
        predict_probabilities(model, TOKENS, mc_dropout="yes")


def test_bad_arguments() -> None:
    model = small_model("softmax")
    with pytest.raises(TypeError, match="torch.nn.Module"):
        monte_carlo_logits(lambda x: x, TOKENS)
    with pytest.raises(ValueError, match="num_samples"):
        monte_carlo_logits(model, TOKENS, num_samples=0)
    with pytest.raises(ValueError, match="batch_size"):
        monte_carlo_logits(model, TOKENS, batch_size=0)
    with pytest.raises(ValueError, match="inputs"):
        monte_carlo_logits(model, TOKENS[:0])


def test_mixed_modes_survive_and_the_passes_run_in_eval_mode() -> None:
    # a model in training with its first block frozen in eval mode: both functions predict in eval mode (no dropout)
    # and give every module back its own mode (model.train(was_training) flattened them)
    model = small_model("kep_svgp", dropout=0.3).train()
    model.blocks[0].eval()
    modes = [module.training for module in model.modules()]
    torch.manual_seed(3)
    logits = monte_carlo_logits(model, TOKENS, mask=MASK, num_samples=3)
    assert [module.training for module in model.modules()] == modes
    torch.manual_seed(3)
    probabilities = predict_probabilities(model, TOKENS, mask=MASK, num_samples=3)
    assert [module.training for module in model.modules()] == modes
    torch.testing.assert_close(logits.softmax(-1).mean(0), probabilities, rtol=1e-12, atol=1e-12)
    torch.manual_seed(3)
    expected = monte_carlo_logits(model.eval(), TOKENS, mask=MASK, num_samples=3)  # all in eval mode
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)


class _MappingClassifier(torch.nn.Module):
    """A Hugging Face style classifier: no mask argument, the logits under "logits" of a dict, dropout inside."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 3, dtype=torch.float64)
        self.dropout = torch.nn.Dropout(0.5)

    def forward(self, inputs: torch.Tensor) -> dict:
        return {"logits": self.linear(self.dropout(inputs)), "hidden": inputs}


def test_a_model_without_a_mask_argument_and_with_a_mapping_output_is_sampled_as_predict_probabilities_calls_it():
    # monte_carlo_logits passed mask=None to every model (a TypeError for one without a mask argument) and stacked its
    # outputs as they came (a TypeError for a dict); predict_probabilities, the mean of their softmaxes, takes both
    model = _MappingClassifier().eval()
    inputs = torch.randn(7, 4, dtype=torch.float64)
    torch.manual_seed(5)
    logits = monte_carlo_logits(model, inputs, num_samples=4, mc_dropout=True)
    torch.manual_seed(5)
    expected = predict_probabilities(model, inputs, num_samples=4, mc_dropout=True)
    assert logits.shape == (4, 7, 3) and not model.training
    assert (logits[0] - logits[1]).abs().max() > 1e-3  # dropout samples
    torch.testing.assert_close(logits.softmax(-1).mean(0), expected, rtol=1e-12, atol=1e-12)
    # without dropout: one pass, by batches, the linear map by hand
    deterministic = monte_carlo_logits(model, inputs, num_samples=4, batch_size=3)
    torch.testing.assert_close(deterministic, (inputs @ model.linear.weight.T + model.linear.bias)[None])


def test_a_mask_of_another_batch_size_is_refused_not_read_in_part() -> None:
    # a mask of 12 rows for 6 inputs was cut with the inputs: the first 6 rows were read, the rest ignored, no error
    model = small_model("softmax").eval()
    longer = torch.cat([MASK, torch.ones_like(MASK)])
    with pytest.raises(
        ValueError, match=r"monte_carlo_logits: expected a mask with one row per input \(6 inputs\), got"
    ):
        monte_carlo_logits(model, TOKENS, mask=longer)
    with pytest.raises(ValueError, match="one row per input"):
        monte_carlo_logits(model, TOKENS, mask=longer, batch_size=4)
    # the right mask, and "causal" (no rows), as before
    assert monte_carlo_logits(model, TOKENS, mask=MASK, batch_size=4).shape == (1, 6, 3)
    assert monte_carlo_logits(model, TOKENS, mask="causal").shape == (1, 6, 3)


def test_mc_dropout_is_a_flag_not_a_truthy_value() -> None:
    # monte_carlo_logits(mc_dropout="no") switched dropout on (a non-empty string is true); NumPy's bools are flags
    model = small_model("softmax", dropout=0.3).eval()
    for function in (monte_carlo_logits, predict_probabilities):
        with pytest.raises(TypeError, match="expected mc_dropout to be True or False, got 'no'"):
            function(model, TOKENS, mc_dropout="no")
    torch.manual_seed(2)
    expected = monte_carlo_logits(model, TOKENS, num_samples=3, mc_dropout=True)
    torch.manual_seed(2)
    torch.testing.assert_close(
        monte_carlo_logits(model, TOKENS, num_samples=3, mc_dropout=np.True_), expected, rtol=0, atol=0
    )
    torch.manual_seed(2)
    got = predict_probabilities(model, TOKENS, num_samples=3, mc_dropout=np.True_)
    torch.testing.assert_close(got, expected.softmax(-1).mean(0), rtol=1e-12, atol=1e-12)
