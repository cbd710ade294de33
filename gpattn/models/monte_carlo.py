"""Monte Carlo logit samples of a classifier with stochastic attention and, optionally, MC dropout."""

from __future__ import annotations

import torch
from torch import Tensor

from .._module_state import kept_call_results, restored_modes
from ..attention import AttentionLayer, sample_attention
from ..mlls.attention_elbo import model_logits
from ..validation import check_bool, check_int, check_tensor
from .monte_carlo_dropout import mc_dropout as dropout_masks

__all__ = ["monte_carlo_logits"]


def check_batch_mask(mask: object, inputs: Tensor, where: str) -> None:
    """Refuse a mask tensor whose first dimension is not the batch of ``inputs``: cut into batches with the inputs, a
    longer mask would be read only in part (its first rows, those of other inputs) without a word."""
    if isinstance(mask, Tensor) and (mask.dim() == 0 or mask.shape[0] != inputs.shape[0]):
        raise ValueError(
            f"{where}: expected a mask with one row per input ({inputs.shape[0]} inputs), got shape {tuple(mask.shape)}"
        )


@torch.no_grad()
def monte_carlo_logits(
    model: torch.nn.Module,
    inputs: Tensor,
    mask: Tensor | str | None = None,
    num_samples: int = 10,
    mc_dropout: bool = False,
    batch_size: int | None = None,
) -> Tensor:
    r"""Logits of :math:`T` stochastic forward passes, :math:`f^{(t)}(x)`, ``(T, B, C)``.

    The model runs in eval mode with :func:`~gpattn.attention.sample_attention` on (the GP attention layers draw
    samples) and, with ``mc_dropout=True``, inside :func:`~gpattn.models.mc_dropout` (dropout masks drawn too, Gal &
    Ghahramani's MC dropout). A model with nothing to sample (no stochastic attention layer and ``mc_dropout=False``)
    is run once: the result then has ``T = 1``. The training mode is restored afterwards; no gradients are recorded;
    the global torch RNG drives the samples. :func:`~gpattn.models.predict_probabilities` is the mean of their
    softmaxes; :class:`~gpattn.models.TemperatureScaling` fits its temperature to them.

    .. note:: Cost: :math:`T` forward passes; memory ``T B C`` for the logits plus one batch's activations.

    :param model: Maps ``(inputs, mask=mask)`` (``inputs`` alone when ``mask`` is ``None``, as
        :func:`~gpattn.models.predict_probabilities` calls it) to logits ``(B, C)``, or to a mapping holding them under
        ``"logits"`` (a dict, a ``transformers`` ``ModelOutput``).
    :param inputs: The model's inputs, batch first.
    :param mask: The model's mask argument (a tensor, one row per input, is cut into batches with ``inputs``).
    :param num_samples: :math:`T \geq 1`.
    :param mc_dropout: Keep the dropout modules on (see :func:`~gpattn.models.mc_dropout`; raises for a model
        without dropout). A bool (Python's or NumPy's): a string such as ``"no"`` is refused, not read as true.
    :param batch_size: Inputs per forward pass, or ``None`` for all at once.
    :return: Logits ``(T, B, C)`` (``T = 1`` for a deterministic model), on the model's device.
    """
    where = "monte_carlo_logits"
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{where}: expected model to be a torch.nn.Module, got {type(model).__name__}")
    check_tensor("inputs", inputs, where=where)
    if inputs.dim() == 0 or inputs.shape[0] == 0:
        raise ValueError(f"{where}: expected inputs with a non-empty batch dimension first, got {tuple(inputs.shape)}")
    check_int("num_samples", num_samples, where=where)
    check_bool("mc_dropout", mc_dropout, where=where)
    if batch_size is not None:
        check_int("batch_size", batch_size, where=where)
    check_batch_mask(mask, inputs, where)
    stochastic = mc_dropout or any(isinstance(m, AttentionLayer) and m.is_stochastic for m in model.modules())
    passes = num_samples if stochastic else 1
    step = inputs.shape[0] if batch_size is None else batch_size
    with (
        restored_modes(model),
        kept_call_results(model),
        sample_attention(model.eval()),
        dropout_masks(model, enabled=mc_dropout),
    ):
        batches = []
        for start in range(0, inputs.shape[0], step):
            batch = inputs[start : start + step]
            if mask is None:
                keywords = {}
            else:
                keywords = {"mask": mask[start : start + step] if isinstance(mask, Tensor) else mask}
            batches.append(torch.stack([model_logits(model(batch, **keywords), where) for _ in range(passes)]))
    return torch.cat(batches, dim=1)  # shape: (T, B, C)
