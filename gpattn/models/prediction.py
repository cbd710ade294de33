"""Monte Carlo prediction of classifiers with stochastic (GP) attention."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from .._module_state import kept_call_results, restored_modes
from ..attention import AttentionLayer, sample_attention
from ..mlls.attention_elbo import model_logits
from ..validation import check_bool, check_choice, check_int
from .monte_carlo_dropout import mc_dropout as dropout_masks

AVERAGES = ("probabilities", "logits")


@torch.no_grad()
def predict_probabilities(
    model: torch.nn.Module,
    inputs: Tensor | Mapping[str, Any],
    mask: Tensor | str | None = None,
    num_samples: int = 10,
    average: str = "probabilities",
    mc_dropout: bool = False,
) -> Tensor:
    r"""Monte Carlo predictive class probabilities of a classifier with stochastic attention.

    The model runs in eval mode (no dropout; with ``mc_dropout``, inside :func:`~gpattn.models.mc_dropout`: dropout
    masks drawn in every pass, Gal & Ghahramani's MC dropout) with :func:`~gpattn.attention.sample_attention` on,
    :math:`T` = ``num_samples`` times; ``average="probabilities"`` returns
    :math:`\frac{1}{T} \sum_t \operatorname{softmax}(\text{logits}^{(t)})` (the predictive distribution, the
    papers' choice), ``"logits"`` returns :math:`\operatorname{softmax}(\frac{1}{T} \sum_t \text{logits}^{(t)})`.
    A model without stochastic layers (and without ``mc_dropout``) is run once. The model's training mode is
    restored afterwards; no gradients are recorded.

    :param model: Maps ``(inputs, mask=mask)`` (``inputs`` alone when ``mask`` is ``None``, ``**inputs`` for a
        mapping) to logits ``(B, C)``, or to a mapping holding them under ``"logits"`` (a dict, a ``transformers``
        ``ModelOutput``).
    :param inputs: The model's inputs: a tensor, or a mapping of keyword arguments (e.g. ``{"input_ids": ...,
        "attention_mask": ...}`` for a Hugging Face model).
    :param mask: The model's mask argument (tensor inputs only).
    :param num_samples: :math:`T \geq 1`.
    :param average: ``"probabilities"`` or ``"logits"``.
    :param mc_dropout: Keep the dropout modules on (raises ``ValueError`` for a model without dropout).
    :return: Class probabilities, shape ``(B, C)``.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"predict_probabilities: expected model to be a torch.nn.Module, got {type(model).__name__}")
    check_int("num_samples", num_samples, where="predict_probabilities")
    check_choice("average", average, AVERAGES, where="predict_probabilities")
    check_bool("mc_dropout", mc_dropout, where="predict_probabilities")
    if isinstance(inputs, Mapping):
        if mask is not None:
            raise ValueError("predict_probabilities: with a mapping of inputs, pass the mask inside it")
        arguments, keywords = (), dict(inputs)
    else:
        arguments, keywords = (inputs,), ({} if mask is None else {"mask": mask})
    if not mc_dropout and not any(isinstance(m, AttentionLayer) and m.is_stochastic for m in model.modules()):
        num_samples = 1  # deterministic in eval mode: every pass would be identical
    with (
        restored_modes(model),
        kept_call_results(model),
        sample_attention(model.eval()),
        dropout_masks(model, enabled=mc_dropout),
    ):
        logits = torch.stack(
            [model_logits(model(*arguments, **keywords), "predict_probabilities") for _ in range(num_samples)]
        )  # shape: (T, B, C)
    if average == "probabilities":
        return logits.softmax(dim=-1).mean(dim=0)
    return logits.mean(dim=0).softmax(dim=-1)
