"""Entropy decomposition of Monte Carlo predictions (gpattn.metrics.uncertainty) against its definition computed with
torch.distributions in float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.distributions import Categorical

from gpattn.metrics import (
    expected_entropy,
    mutual_information,
    ood_auroc,
    ood_auroc_mutual_information,
    predictive_entropy,
)


def _samples(seed: int, shape: tuple[int, int, int], spread: float) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(shape, generator=generator, dtype=torch.float64) * spread
    return logits.softmax(-1)


@pytest.mark.parametrize(("seed", "shape"), [(0, (10, 50, 3)), (1, (1, 7, 10)), (2, (25, 200, 2))])
def test_mutual_information_equals_its_definition_in_float64(seed, shape) -> None:
    samples = _samples(seed, shape, 2.0)
    mean = samples.mean(0)
    total = Categorical(probs=mean).entropy()
    aleatoric = Categorical(probs=samples).entropy().mean(0)
    np.testing.assert_allclose(predictive_entropy(mean), total.numpy(), rtol=0, atol=1e-12)
    np.testing.assert_allclose(expected_entropy(samples), aleatoric.numpy(), rtol=0, atol=1e-12)
    np.testing.assert_allclose(mutual_information(samples), (total - aleatoric).clamp_min(0).numpy(), atol=1e-12)
    # the decomposition: total = aleatoric + epistemic, epistemic >= 0 (one sample: 0)
    assert (mutual_information(samples) >= 0).all()
    if shape[0] == 1:
        assert np.all(mutual_information(samples) == 0.0)


def test_mutual_information_is_zero_when_samples_agree_and_maximal_when_they_disagree() -> None:
    agree = torch.tensor([[[0.2, 0.8]], [[0.2, 0.8]]], dtype=torch.float64)
    assert mutual_information(agree) == pytest.approx([0.0], abs=1e-15)
    disagree = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]], dtype=torch.float64)  # two certain, opposite samples
    assert mutual_information(disagree) == pytest.approx([np.log(2.0)])


@pytest.mark.parametrize(("num_samples", "dtype"), [(3, torch.float64), (7, torch.float64), (10, torch.float32)])
def test_samples_that_agree_tie_exactly(num_samples, dtype) -> None:
    # T equal samples: the mean differs from them by rounding, so H(mean) - mean H is 0 up to ~1e-16, at random; the
    # AUROC ranked those values (0.4744 for T = 7) where the docstring promises ties and 0.5
    rows = _samples(5, (1, 400, 10), 1.0)[0].to(dtype)
    samples = rows.expand(num_samples, -1, -1)
    as_float64 = samples.double()
    by_formula = Categorical(probs=as_float64.mean(0)).entropy() - Categorical(probs=as_float64).entropy().mean(0)
    assert (by_formula != 0).any()  # not vacuous: rounding alone separates some of them
    assert np.all(mutual_information(samples) == 0.0)
    assert ood_auroc_mutual_information(samples[:, :200], samples[:, 200:]) == 0.5


def test_ood_auroc_by_mutual_information_ranks_disagreement_as_ood() -> None:
    inside = _samples(0, (8, 100, 4), 0.1)  # samples that agree: small MI
    outside = _samples(1, (8, 100, 4), 5.0)  # samples that disagree: large MI
    assert ood_auroc_mutual_information(inside, outside) > 0.99
    assert ood_auroc_mutual_information(outside, inside) < 0.01
    # samples that agree on every input have MI 0 everywhere: no separation
    assert ood_auroc_mutual_information(inside[:1].expand(2, -1, -1), outside[:1].expand(4, -1, -1)) == 0.5
    # the max-probability score of the mean prediction is a different score
    assert ood_auroc(inside.mean(0), outside.mean(0)) != ood_auroc_mutual_information(inside, outside)


def test_bad_samples_raise() -> None:
    with pytest.raises(ValueError, match=r"\(T, n, C\)"):
        mutual_information(torch.ones(4, 3) / 3)
    with pytest.raises(ValueError, match="sum to 1"):
        mutual_information(torch.ones(2, 4, 3))
    with pytest.raises(ValueError, match="number of classes"):
        ood_auroc_mutual_information(torch.ones(2, 4, 3) / 3, torch.ones(2, 4, 2) / 2)


def test_nested_lists_are_checked_as_arrays_of_their_own_dtype() -> None:
    # a list of bools was cast to 0/1 probabilities (as predictive_entropy refuses them), strings to a NumPy error
    with pytest.raises(TypeError, match="expected samples to hold real probabilities, got dtype bool"):
        mutual_information([[[True, False]], [[False, True]]])
    with pytest.raises(TypeError, match="expected samples to hold real probabilities, got dtype <U3"):
        expected_entropy([[["0.5", "0.5"]]])
    samples = [[[0.5, 0.5]], [[0.2, 0.8]]]  # integers and floats as before
    mean = np.array([0.35, 0.65])
    expected = -(mean * np.log(mean)).sum() - np.mean([np.log(2), -(0.2 * np.log(0.2) + 0.8 * np.log(0.8))])
    np.testing.assert_allclose(mutual_information(samples), [expected], rtol=1e-14)
    np.testing.assert_array_equal(mutual_information([[[1, 0]], [[0, 1]]]), [np.log(2)])


@pytest.mark.parametrize(("t_in", "t_out", "name"), [(2, 1, "samples_out"), (1, 3, "samples_in"), (1, 1, "samples_in")])
def test_ood_auroc_mutual_information_needs_two_samples_of_each_set(t_in, t_out, name) -> None:
    # one sample has mutual information 0 on every input: its AUROC would be a number that means nothing
    inside, outside = _samples(0, (t_in, 5, 3), 1.0), _samples(1, (t_out, 6, 3), 1.0)
    match = rf"ood_auroc_mutual_information: expected {name} of shape \(T, n, C\) with T >= 2 .*got T = 1"
    with pytest.raises(ValueError, match=match):
        ood_auroc_mutual_information(inside, outside)
    with pytest.raises(ValueError, match=match):  # NumPy arrays alike
        ood_auroc_mutual_information(inside.numpy(), outside.numpy())
    assert 0.0 <= ood_auroc_mutual_information(_samples(0, (2, 5, 3), 1.0), _samples(1, (2, 6, 3), 1.0)) <= 1.0


def test_low_precision_samples_use_their_dtype_tolerance() -> None:
    samples = _samples(3, (4, 20, 10), 1.0).to(torch.bfloat16)
    reference = mutual_information(samples.double() / samples.double().sum(-1, keepdim=True))
    np.testing.assert_allclose(mutual_information(samples), reference, atol=0.05)
