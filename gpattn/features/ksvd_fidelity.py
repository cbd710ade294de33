r"""Does a trained layer actually perform a KSVD of its attention kernel? A diagnostic against the exact SVD.

KEP-SVGP and Primal-Attention read attention as a kernel SVD, but with learned (amortised or per-position) scores
nothing forces the scores to be the singular vectors: :math:`J = 0` is necessary, not sufficient
(docs/math.md section 2), and reproduction studies of such claims ("The Kernel PCA interpretation of self-attention
fails under scrutiny", 2025) found trained models far from them. :func:`ksvd_fidelity` measures, per sequence and
head, how far the learned scores are from the exact top-:math:`s` KSVD of the dense kernel of the same sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from ..ksvd import kernel_svd
from .attention_kernel_eigen_features import AttentionKernelEigenFeatures


@dataclass(frozen=True)
class KSVDFidelity:
    r"""How close learned KSVD scores are to the exact KSVD, per sequence and head (every field ``(B, H)``).

    :ivar relative_objective: :math:`|J| / (\tfrac12 \sum_i e_i^\top \Lambda^{-1} e_i + \tfrac12 \sum_j r_j^\top
        \Lambda^{-1} r_j)`: the KSVD objective relative to the size of its terms; 0 at a stationary point.
    :ivar left_cosine: The mean cosine of the principal angles between :math:`\operatorname{span} e(X)` and the
        exact top-:math:`s` left singular subspace :math:`\operatorname{span} H_e` (1: the same subspace).
    :ivar right_cosine: The same for :math:`\operatorname{span} r(Z)` and :math:`\operatorname{span} H_r`.
    :ivar max_angle: The largest principal angle of either side, in degrees (0: both subspaces exact).
    :ivar singular_value_error: :math:`\|\Lambda - \lambda_{1:s}\| / \|\lambda_{1:s}\|`, the learned singular values
        against the exact ones (both sorted).
    :ivar energy: :math:`\sum_{i \leq s} \lambda_i^2 / \|K\|_F^2`, the share of the kernel the best rank-:math:`s`
        approximation captures (a property of the kernel, not of the scores).
    """

    relative_objective: Tensor
    left_cosine: Tensor
    right_cosine: Tensor
    max_angle: Tensor
    singular_value_error: Tensor
    energy: Tensor

    def summary(self) -> dict[str, float]:
        """The mean of every field over sequences and heads, as plain floats (for result files and tables)."""
        return {field.name: float(getattr(self, field.name).double().mean()) for field in fields(self)}


def _principal_cosines(scores: Tensor, vectors: Tensor) -> Tensor:
    # cosines of the principal angles between span(scores) and span(vectors): singular values of Q_1^T Q_2
    basis = torch.linalg.qr(scores).Q  # (B, H, N, s)
    return torch.linalg.svdvals(basis.mT @ vectors).clamp(0.0, 1.0)  # (B, H, s)


@torch.no_grad()
def ksvd_fidelity(
    features: AttentionKernelEigenFeatures | torch.nn.Module,
    queries: Tensor,
    keys: Tensor | None = None,
    key_mask: Tensor | None = None,
) -> KSVDFidelity:
    r"""Compare the learned KSVD scores of an attention layer with the exact KSVD of the same sequences.

    The features are evaluated on the sequences (eval mode, no penalty refreshed), the dense kernel
    :math:`K = \kappa(X, Z)` of every sequence and head is formed (masked rows and columns zeroed) and decomposed
    exactly, and the scores :math:`e(X)`, :math:`r(Z)` and :math:`\Lambda` are compared with :math:`H_e \Lambda`,
    :math:`H_r \Lambda` and the top-:math:`s` singular values (:class:`KSVDFidelity`). Exact features give zero
    angles, objective and error by construction; so do learned features at a stationary point of the KSVD.

    Example:
        >>> from gpattn.attention import KEPSVGPAttention
        >>> layer = KEPSVGPAttention(embed_dim=16, num_heads=2, num_inducing=3)
        >>> fidelity = ksvd_fidelity(layer, torch.randn(4, 9, 16))
        >>> sorted(fidelity.summary())[:2]
        ['energy', 'left_cosine']

    :param features: :class:`~gpattn.features.AttentionKernelEigenFeatures`, or a layer holding them as
        ``.features`` (KEP-SVGP, Primal-Attention).
    :param queries: The tokens the layer attends from, shape ``(B, N, C)`` (what the layer receives).
    :param keys: Key tokens ``(B, M, C)`` for cross-attention (default: the queries).
    :param key_mask: Boolean padding mask ``(B, M)``, ``True`` for real tokens (self-attention: it masks the queries
        too); the comparison then uses each sequence's real tokens only.
    :return: A :class:`KSVDFidelity` with fields of shape ``(B, H)``.

    .. note:: Cost: the features' forward pass plus the dense kernel, O(N M p) per head, and its SVD, O(N M min(N, M)).
    """
    module = features if isinstance(features, AttentionKernelEigenFeatures) else getattr(features, "features", None)
    if not isinstance(module, AttentionKernelEigenFeatures):
        raise TypeError(
            "ksvd_fidelity: expected AttentionKernelEigenFeatures or a layer holding them as .features (KEP-SVGP, "
            f"Primal-Attention), got {type(features).__name__}"
        )
    self_attention = keys is None
    keys = queries if keys is None else keys
    was_training = module.training
    module.eval()
    try:
        scores = module(queries, None if self_attention else keys, key_mask, objective=True, kernel_diag=False)
    finally:
        module.train(was_training)
    matrix = module.kernel.forward(queries.unsqueeze(1), keys.unsqueeze(1))  # (B, H, N, M)
    if key_mask is not None:
        matrix = matrix * key_mask[:, None, None, :].to(matrix.dtype)
        if self_attention:
            matrix = matrix * key_mask[:, None, :, None].to(matrix.dtype)
    left_scores, right_scores = scores.left_scores, scores.right_scores
    if key_mask is not None:  # compare on the real tokens only (outputs at padded positions are unspecified)
        right_scores = right_scores * key_mask[:, None, :, None].to(right_scores.dtype)
        if self_attention:
            left_scores = left_scores * key_mask[:, None, :, None].to(left_scores.dtype)
    rank = module.num_inducing
    exact = kernel_svd(matrix, min(matrix.shape[-2:]))
    singular_values = exact.singular_values[..., :rank]  # (B, H, s)
    energy = singular_values.pow(2).sum(-1) / matrix.pow(2).sum((-2, -1)).clamp_min(torch.finfo(matrix.dtype).tiny)
    left_cosines = _principal_cosines(left_scores, exact.left[..., :rank])
    right_cosines = _principal_cosines(right_scores, exact.right[..., :rank])
    smallest = torch.minimum(left_cosines.amin(-1), right_cosines.amin(-1))
    learned = scores.singular_values.expand_as(singular_values).sort(dim=-1, descending=True).values
    value_error = (learned - singular_values).norm(dim=-1) / singular_values.norm(dim=-1)
    inverse = scores.singular_values.reciprocal().unsqueeze(-2)
    terms = 0.5 * ((left_scores.pow(2) * inverse).sum((-2, -1)) + (right_scores.pow(2) * inverse).sum((-2, -1)))
    objective = scores.objective.abs() / terms.clamp_min(torch.finfo(terms.dtype).tiny)
    return KSVDFidelity(
        relative_objective=objective,
        left_cosine=left_cosines.mean(-1),
        right_cosine=right_cosines.mean(-1),
        max_angle=torch.rad2deg(torch.arccos(smallest)),
        singular_value_error=value_error,
        energy=energy,
    )
