"""The learned attention features: data-dependent weights, a learned spectrum and the KSVD penalty."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .._torch_compat import values_unreadable
from ..ksvd import ksvd_objective
from ..validation import all_finite, check_overflow, check_token_magnitude, square_limit, within_bound
from .attention_kernel_eigen_features import AttentionKernelEigenFeatures
from .kernel_eigen_scores import KernelEigenScores
from .sequence_sums import unit_quadratic_form

#: the feature columns of one call: P_q (B, H, p, N), nu_q (B, H, 1, N), P_k (B, H, p, M), nu_k (B, H, 1, M) and
#: sqrt(sigma_f) (H, 1, 1)
Columns = tuple[Tensor, Tensor, Tensor, Tensor, Tensor]

#: what overflows, for the magnitude guard's messages, and the power of |x| it grows like
SCORES_GROWTH = (
    "the weights W_e|X and the scores grow like |x| and their squares (the KSVD objective J, the variances of the "
    "draws and of the posterior) like |x|^2"
)
PENALTY_GROWTH = "the KSVD penalty eta J^2 grows like |x|^4"
GRADIENT_GROWTH = "the gradients of the KSVD penalty grow like |x|^5"


class _GradientGuard(torch.autograd.Function):
    """The identity on the tokens whose backward pass checks their gradient: a non-finite gradient from tokens beyond
    :func:`~gpattn.validation.token_magnitude_limit` of power 5 raises the magnitude guard's ``ValueError`` (the
    forward pass cannot see it coming: the penalty is finite when its gradients overflow). ``anchor`` (a parameter)
    makes the output require a gradient whenever the features' parameters do, so that the check runs also for tokens
    that need none. The fused amortised path checks its gradients in its own backward pass instead (the ``guard`` of
    :class:`~gpattn.features.amortized_scores.AmortizedSelfScores`)."""

    @staticmethod
    def forward(ctx, tokens: Tensor, anchor: Tensor, where: str) -> Tensor:
        ctx.save_for_backward(tokens)
        ctx.where = where
        return tokens.view_as(tokens)

    @staticmethod
    def backward(ctx, gradient: Tensor) -> tuple[Tensor, None, None]:
        if not all_finite(gradient):
            (tokens,) = ctx.saved_tensors
            check_token_magnitude(tokens, GRADIENT_GROWTH, ctx.where, power=5)
        return gradient, None, None


class LearnedAttentionFeatures(AttentionKernelEigenFeatures):
    r"""The base class of the learned attention modes (amortised, ``primal_tokens``, ``primal_features``): primal
    scores with data-dependent weights and a learned spectrum (docs/math.md section 2).

    .. math::

        e(X) = \Phi_q W_{e|X}, \qquad r(Z) = \Phi_k W_{r|X}, \qquad W_{e|X}, W_{r|X} \in \mathbb R^{p \times s},

    with the cosine kernel's normalised features :math:`\Phi_q, \Phi_k` and weights that each subclass defines from
    the sequence (:meth:`_weights`). :math:`\Lambda` is a learned positive vector per head (:attr:`learns_spectrum`;
    ``softplus`` above :data:`~gpattn.features.SINGULAR_VALUE_FLOOR`, starting at :math:`\log 2`), and the KSVD
    penalty drives the scores towards a stationary point of the KSVD. Two forms (``ksvd_form``), see
    :func:`~gpattn.ksvd.ksvd_objective`:

    * ``"sum"`` (default): :math:`\eta \operatorname{mean}_b \sum_h J_{bh}^2` with the token-sum
      :math:`J_{bh} = \tfrac12 \sum_i e_i^\top \Lambda^{-1} e_i + \tfrac12 \sum_j r_j^\top \Lambda^{-1} r_j
      - \operatorname{Tr}(W_{e|X}^\top W_{r|X})` of every sequence and head over its real tokens (with a causal mask,
      on the causal scores: :math:`e_i, r_i` of the prefix :math:`j \le i`, and the trace averaged over the prefixes'
      weights);
    * ``"official"`` (:class:`~gpattn.features.PrimalTokensAttentionFeatures` only): the official code's number
      :math:`\eta\, J_{\mathrm{off}}^2`.

    :attr:`KernelEigenScores.objective` is always the sum-form :math:`J` per sequence and head. The arguments are
    those of :class:`~gpattn.features.AttentionKernelEigenFeatures`.

    :raises ValueError: The magnitude guard (:func:`~gpattn.validation.check_overflow`), whose limits
        (:func:`~gpattn.validation.token_magnitude_limit`) cover every quantity a call forms from the tokens, so that
        a result is either finite or this error, never a silent NaN: scores that are not finite or beyond
        :func:`~gpattn.validation.square_limit` (where their squares, i.e. :math:`J`, the variances of the draws and
        of the posterior, overflow) from tokens beyond :math:`\sqrt{\text{finfo.max}} / 10^3`
        (:math:`1.8 \cdot 10^{16}` in float32), in every mode; in training, a KSVD objective :math:`J` beyond that
        bound (the penalty :math:`\eta J^2` grows like
        :math:`|x|^4`) from tokens beyond the limit of power 4 (:math:`1.4 \cdot 10^8` in float32,
        :math:`3.7 \cdot 10^{75}` in float64), and, raised by the backward pass, non-finite gradients (they grow like
        :math:`|x|^5`) from tokens beyond the limit of power 5 (:math:`3.2 \cdot 10^6` in float32, 0.58 in float16).
        Within those ranges every result and gradient is finite for parameters of ordinary size.

    .. note:: Without a causal mask the features stay in the column layout of
        :meth:`~gpattn.kernels.CosineFeatureKernel.feature_columns` and their normalisation, the output scale and the
        padding mask are folded into the ``(s, n)`` values and the ``(p, s)`` weights, so a call costs four GEMMs of
        O(N C p) or O(N C s), four batched products of O(N p s) and elementwise work on ``(N, s)`` tensors only. In
        the learned modes the scores are transposed views of contiguous ``(B, H, s, N)`` tensors.
    """

    learns_spectrum = True
    #: whether the mode has a paired self-attention path (:meth:`takes_paired_path`)
    has_paired_path = False

    def _build(self, max_len: int | None, **options: Any) -> None:
        self._build_weights(max_len, **options)
        # Lambda = softplus(0) = log 2 for every head at initialisation
        self._register_singular_values(torch.full((self.num_heads, self.num_inducing), math.log(2.0)))

    def _build_weights(self, max_len: int | None) -> None:
        """The mode's checks of its arguments and the parameters of its weights (before the learned spectrum)."""
        raise NotImplementedError

    def takes_paired_path(self, queries: Tensor, keys: Tensor, causal: bool, kernel_diag: bool) -> bool:
        """Whether a call takes the mode's paired self-attention path (:meth:`_paired_self_attention`: both branches
        as the halves of one ``(B, 2, H, s, N)`` tensor, :attr:`~gpattn.features.KernelEigenScores.stacked`):
        self-attention (``keys is queries``), no causal mask, no kernel diagonals (the residual needs them) and untied
        weights (one map for both branches has no paired layout), in a mode that has one (:attr:`has_paired_path`).

        :param queries: ``(B, N, C)``.
        :param keys: ``(B, M, C)``.
        :param causal: The call is causal.
        :param kernel_diag: The call asks for the kernel diagonals.
        """
        return self.has_paired_path and queries is keys and not (causal or kernel_diag or self.tie_qk)

    def _paired_self_attention(self, tokens: Tensor, mask: Tensor | None, objective: bool) -> KernelEigenScores:
        """The scores (and :math:`J` with ``objective``) of a call that :meth:`takes_paired_path`."""
        raise NotImplementedError

    def _scores(
        self, queries: Tensor, keys: Tensor, key_mask: Tensor | None, causal: bool, objective: bool, kernel_diag: bool
    ) -> KernelEigenScores:
        if self.takes_paired_path(queries, keys, causal, kernel_diag):
            return self._paired_self_attention(queries, key_mask, objective)
        self_attention = queries is keys
        query_mask = key_mask if self_attention else None
        kernel = self.kernel
        query_columns, query_inverse = kernel.feature_columns(queries, "query")  # P_q (B, H, p, N), nu_q (B, H, 1, N)
        if self_attention and self.tie_qk:
            key_columns, key_inverse = query_columns, query_inverse
        else:
            key_columns, key_inverse = kernel.feature_columns(keys, "key")  # P_k (B, H, p, M), nu_k (B, H, 1, M)
        root_scale = kernel.outputscale.sqrt()[:, None, None]  # sqrt(sigma_f): (H, 1, 1)
        columns = (query_columns, query_inverse, key_columns, key_inverse, root_scale)
        singular_values = self.singular_values
        objective_value = None
        if causal:
            left, right, objective_value = self._causal_scores(queries, columns, singular_values, objective)
        else:
            left_weights, right_weights = self._weights(queries, keys, key_mask, columns)
            # e(X) = Phi_q W_e = sqrt(sigma) diag(nu_q) P_q^T W_e, built as its transpose (B, H, s, N); r(Z) likewise
            left = ((left_weights.mT @ query_columns) * (query_inverse * root_scale)).mT
            right = ((right_weights.mT @ key_columns) * (key_inverse * root_scale)).mT
            if objective:
                objective_value = ksvd_objective(
                    self._zero_masked(left, query_mask),
                    self._zero_masked(right, key_mask),
                    left_weights,
                    right_weights,
                    singular_values.unsqueeze(0),
                )
        left_diag = right_diag = None
        if kernel_diag:
            # k_e(x_i, x_i) = sum_j kappa(x_i, z_j)^2 = sigma^2 sum_j <unit q_i, unit k_j>^2; k_r likewise
            scale = kernel.outputscale.square()[:, None]  # shape: (H, 1)
            left_diag = scale * unit_quadratic_form(
                query_columns, query_inverse, key_columns, key_inverse, key_mask, causal
            )
            right_diag = scale * unit_quadratic_form(
                key_columns, key_inverse, query_columns, query_inverse, query_mask, causal
            )
        return KernelEigenScores(left, right, singular_values, objective_value, left_diag, right_diag)

    def _weights(
        self, queries: Tensor, keys: Tensor, key_mask: Tensor | None, columns: Columns
    ) -> tuple[Tensor, Tensor]:
        r""":math:`W_{e|X}` and :math:`W_{r|X}` of every sequence and head, each ``(B, H, p, s)``, as means of the
        values :math:`a` (:meth:`_value_columns`) over the feature vectors of the visible tokens,
        :math:`W_{e|X} = \Phi_k^\top a_e / |V|` and :math:`W_{r|X} = \Phi_q^\top a_r / |V|` (the weights of
        :meth:`_token_weights`); a subclass with another form overrides this."""
        query_columns, query_inverse, key_columns, key_inverse, root_scale = columns
        query_mask = key_mask if queries is keys else None
        left_values = self._value_columns(keys, "left")  # A_e(Z)^T: (B, H, s, M)
        right_values = self._value_columns(queries, "right")  # A_r(X)^T: (B, H, s, N)
        # W_{e|X}^T = A_e^T Phi_k / |V| = sqrt(sigma) A_e^T diag(nu_k / |V|) P_k^T: (B, H, s, p); W_{r|X} likewise.
        # (Products are arranged so that the long axis N is the columns of every output and operand: batched GEMMs
        # with an (N, s) output are several times slower on CPU, forward and backward.)
        left_weights = (
            root_scale * ((left_values * key_inverse * self._token_weights(keys, key_mask)) @ key_columns.mT).mT
        )
        right_weights = (
            root_scale
            * ((right_values * query_inverse * self._token_weights(queries, query_mask)) @ query_columns.mT).mT
        )
        return left_weights, right_weights

    def _value_columns(self, tokens: Tensor, side: str) -> Tensor:
        """The values :math:`a_j` of :meth:`_weights` in column layout, ``(B, H, s, n)`` or ``(H, s, n)``."""
        raise NotImplementedError

    def _token_weights(self, tokens: Tensor, mask: Tensor | None) -> Tensor | float:
        # the 1/|V| of the masked means over the visible tokens V: a float or (B, 1, 1, n)
        if mask is None:
            return 1.0 / tokens.shape[-2]
        weights = mask.to(tokens.dtype)
        return (weights / weights.sum(-1, keepdim=True))[:, None, None, :]

    def _causal_scores(
        self, tokens: Tensor, columns: Columns, singular_values: Tensor, objective: bool
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """The scores (and :math:`J`) of a causal call, for a mode that :attr:`supports_causal`."""
        raise NotImplementedError

    def _check_magnitude(self, queries: Tensor, keys: Tensor) -> None:
        # scores that overflowed: refuse tokens of magnitude ~sqrt(finfo.max) / 1e3, whose W^T P grows like |x|^2
        check_token_magnitude((queries, keys), SCORES_GROWTH, self._where())

    def _where(self) -> str:
        return f"{type(self).__name__} (features={self.mode!r})"

    def _watches_gradients(self) -> bool:
        # in training the gradients from the tokens are checked; not while compiling or capturing a CUDA graph (the
        # check is a branch on a value read)
        return self.training and torch.is_grad_enabled() and not values_unreadable()

    def _watched(self, queries: Tensor, keys: Tensor, causal: bool, kernel_diag: bool) -> tuple[Tensor, Tensor]:
        # the tokens' gradients checked by _GradientGuard
        anchor = self.raw_singular_values
        if not self._watches_gradients():
            return queries, keys
        watched = _GradientGuard.apply(queries, anchor, self._where())
        return watched, (watched if keys is queries else _GradientGuard.apply(keys, anchor, self._where()))

    def _check_scores(self, scores: KernelEigenScores, official: Tensor | None, queries: Tensor, keys: Tensor) -> None:
        # the scores (their squares must not overflow) and J when it was computed (J^2, the penalty): one fused pass and
        # one synchronisation on the normal path; what overflowed is told apart only when something did
        bound = square_limit(queries.dtype)
        results = [scores.stacked] if scores.stacked is not None else [scores.left_scores, scores.right_scores]
        penalised = scores.objective if official is None else official  # the J whose square is the penalty
        if within_bound([*results, penalised], bound):
            return
        tokens, where = (queries, keys), self._where()
        check_overflow(results, tokens, SCORES_GROWTH, where, bound=bound)
        check_overflow((penalised,), tokens, PENALTY_GROWTH, where, bound=bound, power=4)

    @staticmethod
    def _zero_masked(scores: Tensor, mask: Tensor | None) -> Tensor:
        # (B, N) against (B, H, N, s), or (B, H, ..., N, s) with output dimensions
        if mask is None:
            return scores
        return scores * mask.reshape(mask.shape[0], *(1,) * (scores.dim() - 3), mask.shape[1], 1).to(scores.dtype)
