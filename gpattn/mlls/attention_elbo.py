"""The training loss of classifiers with GP attention (MATH.md section 4)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from gpytorch.mlls import AddedLossTerm
from torch import Tensor

from ..validation import check_float, check_int, check_tensor


def _added_loss_terms(model: torch.nn.Module) -> Iterator[AddedLossTerm]:
    """Every registered, already computed added loss term of ``model`` and its submodules, each once (as
    ``gpytorch.Module.added_loss_terms`` does, but also below a plain ``torch.nn.Module`` root)."""
    seen = set()
    for module in model.modules():
        for term in getattr(module, "_added_loss_terms", {}).values():
            if term is not None and id(term) not in seen:
                seen.add(id(term))
                yield term


class AttentionELBO(torch.nn.Module):
    r"""The negative evidence lower bound of a classifier with GP attention, plus the KSVD penalty: a loss to
    **minimise** (unlike GPyTorch's MLLs, which return the bound to maximise).

    For a minibatch of :math:`B` of the :math:`n` = ``num_data`` training sequences,

    .. math::

        \mathcal L = \frac{1}{B} \sum_{b} \frac{1}{T} \sum_{t=1}^{T} -\log p(y_b \mid F^{(t)})
            + \frac{\beta}{n} \sum_{l, h, \text{branch}} \mathrm{KL}\big(q(u) \,\|\, p(u)\big)
            + \sum_{\text{terms}} \text{term.loss()},

    where the first term is the cross-entropy of the logits averaged over the batch and the :math:`T` Monte Carlo
    samples (a reparameterised estimate of :math:`\mathbb E_q[-\log p(y \mid F)]`), the KL is
    ``model.kl_divergence()`` and the last sum runs over every added loss term registered in the model (the KSVD
    terms :math:`\eta J^2` of the KEP-SVGP and Primal-Attention layers, :class:`~gpattn.mlls.KSVDAddedLossTerm`,
    each weighted by its layer's ``ksvd_weight``: as in GPyTorch's MLLs, a term carries its own weight).
    With :math:`\beta = 1` and no penalty, :math:`\mathcal L` is the negative of GPyTorch's ``VariationalELBO``
    (the per-sequence bound, KL divided by ``num_data``). The official KEP-SVGP code adds the KL without the
    :math:`1 / n`; pass ``beta=num_data`` to reproduce it.

    Call it after the forward pass that produced the logits: the KL and the KSVD terms are those of that pass.

    :param model: A module with ``kl_divergence()`` (e.g. :class:`~gpattn.models.Transformer`).
    :param num_data: Number of training sequences :math:`n`.
    :param beta: KL weight :math:`\beta \geq 0`.
    :param combine_terms: Return the scalar loss (``True``) or a dict of its parts.

    .. note:: Cost: O(T B C) for the cross-entropy plus the model's KL (O(s) to O(s^2 d_out) per KEP head).
    """

    def __init__(self, model: torch.nn.Module, num_data: int, beta: float = 1.0, combine_terms: bool = True):
        super().__init__()
        if not callable(getattr(model, "kl_divergence", None)):
            raise ValueError(f"expected a model with a kl_divergence() method, got {type(model).__name__}")
        check_int("num_data (the training set size)", num_data, where="AttentionELBO")
        check_float("beta", beta, 0.0, where="AttentionELBO")
        self.model = model
        self.num_data = num_data
        self.beta = float(beta)
        self.combine_terms = bool(combine_terms)

    def forward(self, logits: Tensor, targets: Tensor) -> Tensor | dict[str, Tensor]:
        """The loss of the forward pass that produced ``logits``.

        :param logits: Shape ``(B, C)``, or ``(T, B, C)`` for :math:`T` Monte Carlo samples.
        :param targets: Class indices, shape ``(B,)``.
        :return: The loss (a scalar to minimise) or, with ``combine_terms=False``, a dict with the weighted parts
            ``"nll"`` (cross-entropy), ``"kl"`` (:math:`\\beta / n` KL), ``"ksvd"`` (the sum of the added loss
            terms, :math:`\\eta J^2` each) and their sum ``"loss"``.
        """
        # O(1) checks and one min/max over the targets; non-finite logits are left to the training loop, which
        # reports the step (experiments.NonFiniteLossError)
        check_tensor("logits", logits, floating=True, where="AttentionELBO")
        if logits.dim() not in (2, 3):
            raise ValueError(f"AttentionELBO: expected logits of shape (B, C) or (T, B, C), got {tuple(logits.shape)}")
        check_tensor(
            "targets",
            targets,
            integer=True,
            like=logits,
            like_name="the logits",
            match_dtype=False,
            where="AttentionELBO",
        )
        if targets.dim() != 1 or targets.shape[0] != logits.shape[-2]:
            raise ValueError(
                f"AttentionELBO: expected integer targets of shape ({logits.shape[-2]},) (one class index per "
                f"sequence), got {targets.dtype} {tuple(targets.shape)}"
            )
        num_classes = logits.shape[-1]
        if targets.numel() and (targets.min() < 0 or targets.max() >= num_classes):
            raise ValueError(
                f"AttentionELBO: expected targets in [0, {num_classes - 1}] (class indices of {num_classes} logits), "
                f"got values in [{int(targets.min())}, {int(targets.max())}]"
            )
        num_samples = logits.shape[0] if logits.dim() == 3 else 1
        # mean over samples and batch: -1/(T B) sum_{t, b} log p(y_b | F^(t))
        nll = F.cross_entropy(logits.reshape(-1, num_classes), targets.repeat(num_samples))
        kl = self.model.kl_divergence().to(nll) * (self.beta / self.num_data)
        ksvd = torch.zeros_like(nll)
        for term in _added_loss_terms(self.model):
            ksvd = ksvd + term.loss().to(nll)
        loss = nll + kl + ksvd
        if self.combine_terms:
            return loss
        return {"nll": nll, "kl": kl, "ksvd": ksvd, "loss": loss}
