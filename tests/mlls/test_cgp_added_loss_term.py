"""The CGP added loss term: alpha times the mean over sequences, picked up by GPyTorch's MLLs and AttentionELBO."""

from __future__ import annotations

import gpytorch
import pytest
import torch

from gpattn.mlls import AttentionELBO, CGPAddedLossTerm


def test_loss_is_the_weighted_mean_over_sequences():
    objective = torch.tensor([3.0, -1.0, 4.0], dtype=torch.float64)
    torch.testing.assert_close(CGPAddedLossTerm(objective, 0.5).loss(), torch.tensor(1.0, dtype=torch.float64))
    assert CGPAddedLossTerm(objective).loss() == 2.0


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="alpha"):
        CGPAddedLossTerm(torch.ones(2), -1.0)
    with pytest.raises(ValueError, match=r"objective of shape \(B\)"):
        CGPAddedLossTerm(torch.ones(2, 2))
    with pytest.raises(TypeError, match="floating"):
        CGPAddedLossTerm(torch.ones(2, dtype=torch.long))


class _Model(gpytorch.Module):
    def __init__(self, term: CGPAddedLossTerm):
        super().__init__()
        self.register_added_loss_term("cgp_loss")
        self.update_added_loss_term("cgp_loss", term)

    def kl_divergence(self) -> torch.Tensor:
        return torch.zeros(())


def test_attention_elbo_adds_the_term_unscaled_by_the_training_set_size():
    model = _Model(CGPAddedLossTerm(torch.tensor([2.0, 4.0]), 0.25))
    logits, targets = torch.tensor([[2.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 1])
    parts = AttentionELBO(model, num_data=1000, combine_terms=False)(logits, targets)
    torch.testing.assert_close(parts["ksvd"], torch.tensor(0.75))
    cross_entropy = torch.nn.functional.cross_entropy(logits, targets)
    torch.testing.assert_close(parts["loss"], cross_entropy + 0.75)
    assert [term.loss() for term in model.added_loss_terms()] == [torch.tensor(0.75)]
