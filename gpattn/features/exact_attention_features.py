"""Exact attention features: the truncated SVD of the dense attention kernel of every sequence and head."""

from __future__ import annotations

import torch
from torch import Tensor

from ..ksvd import kernel_svd
from ..validation import check_int
from .attention_kernel_eigen_features import AttentionKernelEigenFeatures
from .kernel_eigen_scores import KernelEigenScores, numerically_nonzero

PER_SEQUENCE = (
    "with features='exact' the singular values belong to each sequence: read them (and the active directions) from "
    "the scores of a call, features(x).singular_values"
)


class ExactAttentionFeatures(AttentionKernelEigenFeatures):
    r"""``features="exact"``: the truncated SVD :math:`\kappa(X, Z) \approx H_e \Lambda H_r^\top` of the dense kernel
    of every sequence and head (masked rows and columns zeroed), :math:`e(X) = H_e \Lambda`, :math:`r(Z) = H_r
    \Lambda`, :math:`J = 0` (docs/math.md section 2).

    :math:`\Lambda` belongs to each sequence (:attr:`spectrum_per_call`): the prior :math:`\mathcal N(0, \Lambda^2)`
    and the KL of a strategy are those of a call's scores, and :attr:`singular_values` raises. The singular pairs are
    indexed by their rank and signed by the largest-magnitude entry of :math:`H_e`, so along a smooth path of inputs
    the features jump where two singular values cross or where that entry moves to another token (see
    docs/guide/papers.md). A direction whose singular value is numerically zero (a sequence whose kernel has rank
    below :math:`s`) is marked inactive (:attr:`~gpattn.features.KernelEigenScores.active`) and its :math:`\Lambda`
    set to 1. Self- and cross-attention with padding masks; no causal mask. Both kernels (``"cosine"``,
    ``"exponential"``). The arguments are those of :class:`~gpattn.features.AttentionKernelEigenFeatures`;
    ``max_len``, if given, bounds the sequences (``num_inducing <= max_len``).

    Example:
        >>> features = ExactAttentionFeatures(embed_dim=16, num_heads=2, num_inducing=3)
        >>> scores = features(torch.randn(4, 9, 16))
        >>> scores.left_scores.shape, scores.singular_values.shape  # a Lambda per sequence and head
        (torch.Size([4, 2, 9, 3]), torch.Size([4, 2, 3]))
        >>> float(scores.objective.abs().max())  # J = 0: an exact KSVD
        0.0

    .. note:: Cost O(N M p + N M min(N, M)) per sequence and head: the dense kernel and its SVD.
    """

    mode = "exact"
    spectrum_per_call = True
    supports_graph_capture = False  # the SVD reads its convergence on the host (and the kernel's finiteness)
    kernels = ("cosine", "exponential")
    supported_calls = (
        "self- and cross-attention with padding masks, but no causal mask: it mixes every token through the SVD"
    )

    def _build(self, max_len: int | None) -> None:
        where = type(self).__name__
        if max_len is not None and check_int("max_len", max_len, where=where) < self.num_inducing:
            # the SVD of a sequence of at most max_len tokens has at most max_len singular values
            raise ValueError(
                f"{where}: num_inducing ({self.num_inducing}) exceeds the longest sequence, max_len={max_len}, of "
                "exact mode"
            )

    def _exact_singular_values(self) -> Tensor:
        raise RuntimeError(PER_SEQUENCE)

    @property
    def active_inducing(self) -> Tensor | None:
        """Raises ``RuntimeError``: the active directions belong to each sequence
        (:attr:`~gpattn.features.KernelEigenScores.active` of a call's scores, shape ``(B, H, s)``)."""
        raise RuntimeError(PER_SEQUENCE)

    def _scores(
        self, queries: Tensor, keys: Tensor, key_mask: Tensor | None, causal: bool, objective: bool, kernel_diag: bool
    ) -> KernelEigenScores:
        query_mask = key_mask if queries is keys else None
        matrix = self.kernel.forward(queries.unsqueeze(1), keys.unsqueeze(1))  # shape: (B, H, N, M)
        if key_mask is not None:
            matrix = matrix * key_mask[:, None, None, :].to(matrix.dtype)
        if query_mask is not None:
            matrix = matrix * query_mask[:, None, :, None].to(matrix.dtype)
        visible = min(
            queries.shape[-2] if query_mask is None else int(query_mask.sum(-1).min()),
            keys.shape[-2] if key_mask is None else int(key_mask.sum(-1).min()),
        )
        if self.num_inducing > visible:
            raise ValueError(
                f"num_inducing ({self.num_inducing}) exceeds the shortest sequence in the batch ({visible} tokens)"
            )
        svd = kernel_svd(matrix, self.num_inducing)
        left = svd.left * svd.singular_values.unsqueeze(-2)  # e(X) = K H_r = H_e Lambda
        right = svd.right * svd.singular_values.unsqueeze(-2)  # r(Z) = K^T H_e = H_r Lambda
        # a sequence whose kernel has rank < s has lambda_k = 0 (to rounding): such a direction is left out of both the
        # output and the KL (KernelEigenScores.active: zero interpolation column, unit prior) and its Lambda is set
        # to 1 so that nothing divides by it; the others are the exact decomposition's
        values = svd.singular_values
        active = numerically_nonzero(values, max(matrix.shape[-2:]))
        singular_values = torch.where(active, values, torch.ones_like(values))  # shape: (B, H, s)
        zero_objective = torch.zeros(matrix.shape[:2], dtype=matrix.dtype, device=matrix.device)
        left_diag, right_diag = (matrix.pow(2).sum(-1), matrix.pow(2).sum(-2)) if kernel_diag else (None, None)
        return KernelEigenScores(left, right, singular_values, zero_objective, left_diag, right_diag, active)
