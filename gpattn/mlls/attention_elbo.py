"""The training loss of classifiers with GP attention (docs/math.md section 4)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from gpytorch.mlls import AddedLossTerm
from torch import Tensor

from .._torch_compat import is_capturing
from ..validation import all_finite, assert_indices_on_device, check_float, check_int, check_tensor
from .sequence_kl_added_loss_term import SequenceKLAddedLossTerm


def _added_loss_terms(model: torch.nn.Module) -> Iterator[AddedLossTerm]:
    """Every registered, already computed added loss term of ``model`` and its submodules, each once (as
    ``gpytorch.Module.added_loss_terms`` does, but also below a plain ``torch.nn.Module`` root)."""
    seen = set()
    for module in model.modules():
        for term in getattr(module, "_added_loss_terms", {}).values():
            if term is not None and id(term) not in seen:
                seen.add(id(term))
                yield term


def _log_prior(model: torch.nn.Module) -> Iterator[Tensor]:
    """:math:`\\log p(\\theta)` of every hyperparameter prior registered in ``model`` and its submodules (GPyTorch's
    ``register_prior``, e.g. ``RBFKernel(lengthscale_prior=...)``), each module once, each summed over its entries
    (as GPyTorch's approximate MLLs sum ``named_priors()``)."""
    for module in model.modules():
        for prior, closure, _ in getattr(module, "_priors", {}).values():
            if prior is not None:
                yield prior.log_prob(closure(module)).sum()


def _weight(value: float | Tensor, like: Tensor) -> float | Tensor:
    """A loss weight as the products use it: a float as it is; a tensor (the training loop's :math:`\\beta` while a
    CUDA graph replays its steps, filled before each replay) rounded to the loss's dtype, as a float multiplying a
    tensor is, so that both give the same numbers."""
    return value.to(like.dtype) if torch.is_tensor(value) else value


def _kl_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """``[model]`` when it has ``kl_divergence()``; else its outermost submodules that have one (the GP layers of a
    foreign model; what is below them is theirs), each once."""
    if callable(getattr(model, "kl_divergence", None)):
        return [model]
    found: dict[int, torch.nn.Module] = {}
    pending = list(model.children())
    while pending:
        module = pending.pop(0)
        if callable(getattr(module, "kl_divergence", None)):
            found.setdefault(id(module), module)
        else:
            pending[:0] = list(module.children())  # depth first: model order
    return list(found.values())


def model_logits(output: Any, where: str = "model_logits") -> Tensor:
    """The logits in a model's output: the output itself when it is a tensor, its ``"logits"`` entry when it is a
    mapping (a dict, or a ``transformers`` ``ModelOutput`` such as ``SequenceClassifierOutput``).

    :param output: What the model's forward returned.
    :param where: The caller, for the messages.
    :return: The logits, shape ``(B, C)`` (or ``(T, B, C)``).
    :raises TypeError: Any other output (e.g. a tuple: pass ``return_dict=True`` or wrap the model).
    """
    if isinstance(output, Tensor):
        return output
    if isinstance(output, Mapping):
        if output.get("logits") is None:
            raise ValueError(f"{where}: the model's output has no 'logits' entry (it has {list(output)})")
        return output["logits"]
    raise TypeError(
        f"{where}: expected the model to return logits as a Tensor or a mapping with a 'logits' entry (a dict, a "
        f"transformers ModelOutput), got {type(output).__name__}"
    )


class AttentionELBO(torch.nn.Module):
    r"""The negative evidence lower bound of a classifier with GP attention, plus the KSVD penalty: a loss to
    **minimise** (unlike GPyTorch's MLLs, which return the bound to maximise).

    For a minibatch of :math:`B` of the :math:`n` = ``num_data`` training sequences,

    .. math::

        \mathcal L = \frac{1}{B} \sum_{b} \frac{1}{T} \sum_{t=1}^{T} -\log p(y_b \mid F^{(t)})
            + \frac{\beta}{n} \sum_{l, h, \text{branch}} \mathrm{KL}\big(q(u) \,\|\, p(u)\big)
            + \beta \sum_{\text{sequence terms}} \frac1B \sum_b \mathrm{KL}_b
            + \sum_{\text{other terms}} \text{term.loss()}
            - \frac{1}{n} \sum_{\text{priors}} \log p(\theta),

    where the first term is the cross-entropy of the logits averaged over the batch and the :math:`T` Monte Carlo
    samples (a reparameterised estimate of :math:`\mathbb E_q[-\log p(y \mid F)]`), the KL of the global
    posteriors is ``model.kl_divergence()`` (for a model without one, e.g. a timm or Hugging Face model converted by
    :mod:`gpattn.integrations`, the sum of ``kl_divergence()`` over its outermost submodules that have one: every
    gpattn attention layer), the per-sequence KL terms are the model's
    :class:`~gpattn.mlls.SequenceKLAddedLossTerm` (SGPA's amortised posterior on the values: weight :math:`\beta` per
    sequence, not divided by :math:`n`, as in the ELBO with local latent variables and in SGPA's paper and code; with
    ``kl_weighting="official"`` SGPA's global KL rides in that term too, at weight :math:`\beta`) and
    the fourth sum runs over every other added loss term registered in the model (the KSVD terms :math:`\eta J^2` of the
    KEP-SVGP and Primal-Attention layers, :class:`~gpattn.mlls.KSVDAddedLossTerm`, each weighted by its layer's
    ``ksvd_weight``, and CGPT's :class:`~gpattn.mlls.CGPAddedLossTerm`: as in GPyTorch's MLLs, a term carries its own
    weight), and the fifth over the hyperparameter priors registered in the model (GPyTorch's ``register_prior``,
    e.g. ``RBFKernel(lengthscale_prior=GammaPrior(...))`` in the symmetric SVGP attention; none by default), divided by
    :math:`n` as GPyTorch's approximate MLLs divide them. With :math:`\beta = 1` and no penalty, :math:`\mathcal L`
    is the negative of GPyTorch's ``VariationalELBO`` (the per-sequence bound, global KL and log prior divided by
    ``num_data``). The official KEP-SVGP code adds
    the KL without the :math:`1 / n`; pass ``beta=num_data`` to reproduce it. docs/guide/papers.md states every
    attention's objective with its weights.

    Call it after the forward pass that produced the logits: the KL and the KSVD terms are those of that pass.

    :param model: A module with ``kl_divergence()`` (e.g. :class:`~gpattn.models.Transformer`), or any module with
        submodules that have one (a converted timm or Hugging Face model).
    :param num_data: Number of training sequences :math:`n`.
    :param beta: KL weight :math:`\beta \geq 0` (the attribute may be set to a 0-dimensional tensor, as the training
        loop does while a CUDA graph replays its steps: a float would be frozen into the graph; a number set later is
        checked as this argument is, a tensor's values are not read).
    :param combine_terms: Return the scalar loss (``True``) or a dict of its parts.
    :param check_finite: Refuse NaN or infinite logits with a ``ValueError`` (default). A training loop that checks the
        loss itself, to restore its last good state and report the step (as :func:`~gpattn.training.train_model`
        does), passes ``False`` and gets the non-finite parts. Nothing is read while a CUDA graph is captured: the
        logits are not checked then, and the targets' range is a device-side assertion.

    .. note:: Cost: O(T B C) for the cross-entropy plus the model's KL (O(s) to O(s^2 d_out) per KEP head).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        num_data: int,
        beta: float = 1.0,
        combine_terms: bool = True,
        check_finite: bool = True,
    ):
        super().__init__()
        if not isinstance(model, torch.nn.Module) or not _kl_modules(model):
            raise ValueError(
                f"expected a model with a kl_divergence() method, or with submodules that have one (GP attention "
                f"layers), got {type(model).__name__}"
            )
        check_int("num_data (the training set size)", num_data, where="AttentionELBO")
        check_float("beta", beta, 0.0, where="AttentionELBO")
        self.model = model
        self.num_data = num_data
        self.beta = float(beta)
        self.combine_terms = bool(combine_terms)
        self.check_finite = bool(check_finite)

    @property
    def beta(self) -> float | Tensor:
        """The KL weight :math:`\\beta`: a float, or the 0-dimensional floating-point tensor (shape ``()``) it was set
        to."""
        return self._beta

    @beta.setter
    def beta(self, value: float | Tensor) -> None:
        # O(1), no read of a tensor's value (the training loop fills its tensor in place while a CUDA graph replays)
        if torch.is_tensor(value) and value.dim() == 0 and value.is_floating_point():
            self._beta = value
        else:  # a negative weight would reward a growing KL: refused as the constructor's argument is
            self._beta = check_float("beta", value, 0.0, where="AttentionELBO")

    def forward(self, logits: Tensor | Mapping[str, Any], targets: Tensor) -> Tensor | dict[str, Tensor]:
        """The loss of the forward pass that produced ``logits``.

        :param logits: Shape ``(B, C)``, or ``(T, B, C)`` for :math:`T` Monte Carlo samples; or the model's output
            holding them under ``"logits"`` (a dict, a ``transformers`` ``ModelOutput``).
        :param targets: Class indices, shape ``(B,)``.
        :return: The loss (a scalar to minimise) or, with ``combine_terms=False``, a dict with the weighted parts
            ``"nll"`` (cross-entropy), ``"kl"`` (:math:`\\beta / n` global KL plus :math:`\\beta` times the per-sequence
            KL terms), ``"ksvd"`` (the sum of the other added loss terms, :math:`\\eta J^2` each), ``"prior"``
            (:math:`-\\frac{1}{n} \\sum \\log p(\\theta)` of GPyTorch's hyperparameter priors; 0 without one) and their
            sum ``"loss"``.
        :raises ValueError: NaN or infinite logits (e.g. a diverged model), naming how many entries (unless
            ``check_finite=False``); an empty batch (no sample, sequence or class); a single class (its cross-entropy
            is 0 whatever the logits).
        """
        # O(1) checks, one min/max over the targets and one over the logits
        if isinstance(logits, Mapping):
            logits = model_logits(logits, where="AttentionELBO")
        check_tensor("logits", logits, floating=True, where="AttentionELBO")
        if logits.dim() not in (2, 3):
            raise ValueError(f"AttentionELBO: expected logits of shape (B, C) or (T, B, C), got {tuple(logits.shape)}")
        if logits.numel() == 0:  # the mean cross-entropy of no sequence is NaN
            raise ValueError(
                f"AttentionELBO: expected logits of at least one sample, sequence and class, got shape "
                f"{tuple(logits.shape)} (the loss of an empty batch is undefined)"
            )
        if logits.shape[-1] < 2:  # log softmax of one logit is 0: a loss that trains nothing
            raise ValueError(
                f"AttentionELBO: expected logits of at least 2 classes, got shape {tuple(logits.shape)} (the "
                "cross-entropy of a single class is 0 whatever the model; a binary classifier needs 2 logits)"
            )
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
        if is_capturing():  # a CUDA graph: no read; the range checked on the device at every replay
            assert_indices_on_device(targets, num_classes, f"AttentionELBO: expected targets in [0, {num_classes - 1}]")
            low, high = 0, 0
        else:  # the range in one read of the device (one synchronisation on a GPU, not two)
            low, high = torch.stack((targets.min(), targets.max())).tolist() if targets.numel() else (0, 0)
        if low < 0 or high >= num_classes:
            raise ValueError(
                f"AttentionELBO: expected targets in [0, {num_classes - 1}] (class indices of {num_classes} logits), "
                f"got values in [{low}, {high}]"
            )
        if self.check_finite and not is_capturing() and not all_finite(logits.detach()):  # a graph: no read
            bad = int((~torch.isfinite(logits.detach())).sum())
            raise ValueError(
                f"AttentionELBO: the logits contain NaN or Inf values ({bad} of {logits.numel()} entries): the model's "
                "forward pass produced them (e.g. diverged parameters or non-finite inputs)"
            )
        num_samples = logits.shape[0] if logits.dim() == 3 else 1
        # mean over samples and batch: -1/(T B) sum_{t, b} log p(y_b | F^(t))
        # class indices of any integer dtype (cross_entropy takes int64 or uint8 only): a no-op for int64
        nll = F.cross_entropy(logits.reshape(-1, num_classes), targets.to(torch.int64).repeat(num_samples))
        kl = torch.zeros_like(nll)
        for module in _kl_modules(self.model):
            kl = kl + module.kl_divergence().to(nll)
        kl = kl * _weight(self.beta / self.num_data, nll)
        ksvd = torch.zeros_like(nll)
        for term in _added_loss_terms(self.model):
            if isinstance(term, SequenceKLAddedLossTerm):  # a per-sequence KL: weight beta per sequence, no 1/n
                kl = kl + _weight(self.beta, nll) * term.loss().to(nll)
            else:
                ksvd = ksvd + term.loss().to(nll)
        loss = nll + kl + ksvd
        log_priors = [log_prior.to(nll) for log_prior in _log_prior(self.model)]  # GPyTorch's hyperparameter priors
        if log_priors:  # -(1/n) sum log p(theta); without a prior the loss's operators are unchanged
            prior = -torch.stack(log_priors).sum() / self.num_data
            loss = loss + prior
        else:
            prior = torch.zeros_like(nll)
        if self.combine_terms:
            return loss
        return {"nll": nll, "kl": kl, "ksvd": ksvd, "prior": prior, "loss": loss}
