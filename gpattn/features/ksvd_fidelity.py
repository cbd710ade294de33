r"""Does a trained layer actually perform a KSVD of its attention kernel? A diagnostic against the exact SVD, with its
chance level.

KEP-SVGP and Primal-Attention read attention as a kernel SVD, but with learned (amortised or per-position) scores
nothing forces the scores to be the singular vectors: :math:`J = 0` is necessary, not sufficient
(docs/math.md section 2), and reproduction studies of such claims ("The Kernel PCA interpretation of self-attention
fails under scrutiny", 2025) found trained models far from them. :func:`ksvd_fidelity` measures, per sequence and
head, how far the learned scores are from the exact top-:math:`s` KSVD of the dense kernel of the same sequence, and
what uniformly random :math:`s`-dimensional subspaces score on the same measures (the chance level: a number near it
says nothing about the layer).

For one sequence and head, :math:`K = \kappa(X, Z)` is the dense ``N x M`` kernel of the real tokens with singular
values :math:`\sigma_1 \geq \sigma_2 \geq \dots` and singular vectors :math:`H_e, H_r`; the layer has rank :math:`s`
and scores :math:`e(X)`, :math:`r(Z)`, :math:`\Lambda`. The **learned rank-s kernel** is the layer's low-rank reading
of its kernel,

.. math::

    \hat K = e(X)\, \Lambda^{-1} r(Z)^\top

(every mode: amortised :math:`e = \kappa(X, Z) A_e(Z) / M`, ``primal_tokens`` :math:`e = \Phi_q \tilde X^\top \tilde
W_e`, exact :math:`e = H_e \Lambda`); at a stationary point :math:`e = H_e \Lambda`, :math:`r = H_r \Lambda`, so
:math:`\hat K = H_e \Lambda H_r^\top = K_s`, the truncation of :math:`K` to its top :math:`s` singular triplets.
Only the directions the layer and the kernel hold are compared: the top :math:`k \leq s` singular vectors whose
singular values are numerically nonzero (:func:`~gpattn.features.numerically_nonzero`; :math:`k < s` when the kernel
has rank below :math:`s`, e.g. identical tokens) and the directions the layer leaves active
(:attr:`~gpattn.features.KernelEigenScores.active`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from .._module_state import kept_call_results, restored_modes
from ..validation import InputTypeError, check_int, check_seed, check_tensor
from .attention_kernel_eigen_features import AttentionKernelEigenFeatures
from .kernel_eigen_scores import numerically_nonzero

#: Random frames per sequence and head of the chance level (:func:`ksvd_fidelity`'s ``random_samples``).
DEFAULT_RANDOM_SAMPLES = 32


@dataclass(frozen=True)
class KSVDFidelity:
    r"""How close learned KSVD scores are to the exact KSVD, per sequence and head (every field ``(B, H)``), and the
    same measures for uniformly random subspaces (fields ``random_*``). See the module docstring for :math:`K`,
    :math:`\hat K`, :math:`k` and :math:`s`.

    :ivar relative_objective: :math:`|J| / (\tfrac12 \sum_i e_i^\top \Lambda^{-1} e_i + \tfrac12 \sum_j r_j^\top
        \Lambda^{-1} r_j)`: the KSVD objective relative to the size of its terms; 0 at a stationary point.
    :ivar left_cosine: The cosines of the principal angles between :math:`\operatorname{span} e(X)` and the exact
        top-:math:`k` left singular subspace, summed and divided by :math:`k` (1: the learned span holds that
        subspace; a direction the learned span misses counts 0).
    :ivar right_cosine: The same for :math:`\operatorname{span} r(Z)` and the right singular subspace.
    :ivar max_angle: The largest of those :math:`k` principal angles of either side, in degrees (0: exact).
    :ivar singular_value_error: :math:`\|\Lambda - \sigma_{1:s}\| / \|\sigma_{1:s}\|` over the layer's active
        directions, the learned singular values against the exact ones (both sorted).
    :ivar kernel_error: :math:`\|K - \hat K\|_F / \|K\|_F`, the relative error of the learned rank-:math:`s` kernel
        (above 1 when :math:`\hat K` is further from :math:`K` than the zero matrix).
    :ivar kernel_scale: :math:`\|\hat K\|_F / \|K\|_F`, the size of the learned rank-:math:`s` kernel
        (:math:`\sqrt{\text{energy}}` at a stationary point; near 0 when the scores collapsed, which makes :math:`J`
        small without a KSVD and ``kernel_error`` near 1).
    :ivar optimal_error: :math:`\|K - K_s\|_F / \|K\|_F = (\sum_{i > s} \sigma_i^2)^{1/2} / \|K\|_F`, the least
        relative error of any rank-:math:`s` matrix (Eckart-Young), so ``kernel_error >= optimal_error``.
    :ivar energy: :math:`\sum_{i \leq s} \sigma_i^2 / \|K\|_F^2 = 1 - \text{optimal\_error}^2`, the share of the
        kernel in its top :math:`s` singular values (a property of the kernel, not of the scores).
    :ivar effective_rank: :math:`\exp(-\sum_i p_i \log p_i)` with :math:`p_i = \sigma_i^2 / \|K\|_F^2`: the
        exponential of the entropy of the kernel's energy spectrum (:math:`r` for :math:`r` equal singular values, 1
        for rank 1). A rank :math:`s` near or above it makes ``energy`` near 1 and the cosines high by construction.
    :ivar random_left_cosine: ``left_cosine`` of uniformly random frames :math:`Q` (Haar measure on the orthonormal
        frames of the real tokens' coordinates, as many columns as the layer's active directions) in place of the
        learned span: the chance level, mean over ``random_samples`` frames. For :math:`k = s` directions in
        :math:`\mathbb R^N` the mean **squared** cosine is :math:`s / N` in expectation.
    :ivar random_right_cosine: The same on the right (:math:`\mathbb R^M`).
    :ivar random_max_angle: ``max_angle`` of the random frames, mean over the samples.
    :ivar random_kernel_error: The root mean square of :math:`\|K - Q Q^\top K V V^\top\|_F / \|K\|_F` over
        independent random frames :math:`Q, V` (the least error of a rank-:math:`s` kernel with random singular
        subspaces), exactly :math:`(1 - a^2 / (N M))^{1/2}` whatever :math:`K` is, with :math:`a` the layer's active
        directions (:math:`s` for learned features): :math:`\mathbb E\, Q Q^\top = (a / N) I`, so
        :math:`\mathbb E \|Q^\top K V\|_F^2 = a^2 \|K\|_F^2 / (N M)`.
    """

    relative_objective: Tensor
    left_cosine: Tensor
    right_cosine: Tensor
    max_angle: Tensor
    singular_value_error: Tensor
    kernel_error: Tensor
    kernel_scale: Tensor
    optimal_error: Tensor
    energy: Tensor
    effective_rank: Tensor
    random_left_cosine: Tensor
    random_right_cosine: Tensor
    random_max_angle: Tensor
    random_kernel_error: Tensor

    def summary(self) -> dict[str, float]:
        """The mean of every field over sequences and heads, as plain floats (for result files and tables)."""
        return {field.name: float(getattr(self, field.name).double().mean()) for field in fields(self)}


def _span(matrix: Tensor, columns: Tensor) -> Tensor:
    # an orthonormal basis of the span of the kept columns of ``matrix`` (..., n, s), padded with zero columns: the left
    # singular vectors of the numerically nonzero singular values (a QR would invent directions for a rank-deficient
    # matrix, e.g. the scores of a kernel of rank below s)
    left, values, _ = torch.linalg.svd(torch.where(columns.unsqueeze(-2), matrix, 0.0), full_matrices=False)
    return left * numerically_nonzero(values, max(matrix.shape[-2:])).unsqueeze(-2).to(left.dtype)


def _subspace_agreement(basis: Tensor, reference: Tensor, count: Tensor) -> tuple[Tensor, Tensor]:
    # the cosines of the principal angles between span(basis) and the ``count`` reference directions (both
    # orthonormal up to zero columns): their sum / count and the smallest of the top ``count`` cosines
    cosines = torch.linalg.svdvals(basis.mT @ reference).clamp(0.0, 1.0)  # sorted, descending: (..., s)
    index = (count - 1).clamp_min(0).unsqueeze(-1).expand(*cosines.shape[:-1], 1)
    undefined = count == 0  # a zero kernel: nothing to compare with
    mean = torch.where(undefined, torch.nan, cosines.sum(-1) / count.clamp_min(1))
    smallest = torch.where(undefined, torch.nan, cosines.gather(-1, index).squeeze(-1))
    return mean, smallest


def _random_frames(
    samples: int, reference: Tensor, active: Tensor, mask: Tensor | None, generator: torch.Generator
) -> Tensor:
    # Haar frames on the real tokens' coordinates, as many columns as the layer's active directions: Gaussian matrices
    # (T, B, H, n, s) (drawn in float64 on the CPU, so that a seed gives the same frames everywhere) with the padded
    # rows zeroed, orthonormalised by _span
    shape = (samples, *reference.shape[:-1], active.shape[-1])
    gaussian = torch.randn(shape, generator=generator, dtype=torch.float64).to(reference)
    if mask is not None:
        gaussian = gaussian * mask[:, None, :, None].to(reference.dtype)
    return _span(gaussian, active)


def _random_cosines(
    left_reference: Tensor,
    right_reference: Tensor,
    count: Tensor,
    active: Tensor,
    row_mask: Tensor | None,
    column_mask: Tensor | None,
    samples: int,
    seed: int,
) -> tuple[Tensor, Tensor, Tensor]:
    # random_left_cosine, random_right_cosine and random_max_angle (see KSVDFidelity): means over ``samples`` frames
    generator = torch.Generator().manual_seed(seed)
    left = _random_frames(samples, left_reference, active, row_mask, generator)  # Q: (T, B, H, N, s)
    right = _random_frames(samples, right_reference, active, column_mask, generator)  # V: (T, B, H, M, s)
    left_mean, left_smallest = _subspace_agreement(left, left_reference, count)
    right_mean, right_smallest = _subspace_agreement(right, right_reference, count)
    angle = torch.rad2deg(torch.arccos(torch.minimum(left_smallest, right_smallest)))
    return left_mean.mean(0), right_mean.mean(0), angle.mean(0)


def _evaluated(
    module: AttentionKernelEigenFeatures,
    queries: Tensor,
    keys: Tensor,
    key_mask: Tensor | None,
    row_mask: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    # the dense kernel (B, H, N, M), e (B, H, N, s), r (B, H, M, s), Lambda (B, H, s), the layer's active directions
    # (B, H, s) and J (B, H) of a call in eval mode, masked rows of K, e and r and inactive columns of e and r zeroed
    with restored_modes(module), kept_call_results(module):
        scores = module.eval()(queries, None if keys is queries else keys, key_mask, objective=True, kernel_diag=False)
    matrix = module.kernel.forward(queries.unsqueeze(1), keys.unsqueeze(1))  # (B, H, N, M)
    left_scores, right_scores = scores.left_scores, scores.right_scores
    if key_mask is not None:  # compare on the real tokens only (outputs at padded positions are unspecified)
        matrix = matrix * key_mask[:, None, None, :].to(matrix.dtype)
        right_scores = right_scores * key_mask[:, None, :, None].to(right_scores.dtype)
    if row_mask is not None:
        matrix = matrix * row_mask[:, None, :, None].to(matrix.dtype)
        left_scores = left_scores * row_mask[:, None, :, None].to(left_scores.dtype)
    # the layer's active directions (all, for learned features; the exact layer leaves out its zero singular values)
    singular_values = scores.singular_values.expand(*matrix.shape[:2], module.num_inducing)
    active = torch.ones_like(singular_values, dtype=torch.bool) if scores.active is None else scores.active
    active = active.expand_as(singular_values)
    left_scores = torch.where(active.unsqueeze(-2), left_scores, 0.0)
    right_scores = torch.where(active.unsqueeze(-2), right_scores, 0.0)
    return matrix, left_scores, right_scores, singular_values, active, scores.ksvd_objective()


def _spectrum_measures(sigma: Tensor, rank: int) -> tuple[Tensor, Tensor, Tensor]:
    # optimal_error, energy and effective_rank (see KSVDFidelity) of singular values (B, H, min(N, M))
    squares = sigma.pow(2)
    total = squares.sum(-1).clamp_min(torch.finfo(sigma.dtype).tiny)
    optimal_error = (squares[..., rank:].sum(-1) / total).sqrt()  # summed directly: no cancellation
    energy = squares[..., :rank].sum(-1) / total
    shares = squares / total.unsqueeze(-1)
    return optimal_error, energy, torch.exp(-torch.special.xlogy(shares, shares).sum(-1))


@torch.no_grad()
def ksvd_fidelity(
    features: AttentionKernelEigenFeatures | torch.nn.Module,
    queries: Tensor,
    keys: Tensor | None = None,
    key_mask: Tensor | None = None,
    *,
    random_samples: int = DEFAULT_RANDOM_SAMPLES,
    seed: int = 0,
) -> KSVDFidelity:
    r"""Compare the learned KSVD scores of an attention layer with the exact KSVD of the same sequences, and with
    random subspaces.

    The features are evaluated on the sequences (eval mode, no penalty refreshed), the dense kernel
    :math:`K = \kappa(X, Z)` of every sequence and head is formed (masked rows and columns zeroed) and decomposed
    exactly, and the scores :math:`e(X)`, :math:`r(Z)`, :math:`\Lambda` and the learned rank-:math:`s` kernel
    :math:`\hat K = e \Lambda^{-1} r^\top` are compared with the exact singular subspaces, singular values and the
    truncation :math:`K_s` (:class:`KSVDFidelity`, definitions in the module docstring). Exact features give zero
    angles, objective and singular-value error and ``kernel_error == optimal_error`` by construction; so do learned
    features at a stationary point of the KSVD.

    Example:
        >>> from gpattn.attention import KEPSVGPAttention
        >>> layer = KEPSVGPAttention(embed_dim=16, num_heads=2, num_inducing=3)
        >>> fidelity = ksvd_fidelity(layer, torch.randn(4, 9, 16))
        >>> sorted(fidelity.summary())[:3]
        ['effective_rank', 'energy', 'kernel_error']

    :param features: :class:`~gpattn.features.AttentionKernelEigenFeatures`, or a layer holding them as
        ``.features`` (KEP-SVGP, Primal-Attention).
    :param queries: The tokens the layer attends from, shape ``(B, N, C)`` (what the layer receives).
    :param keys: Key tokens ``(B, M, C)`` for cross-attention (default: the queries).
    :param key_mask: Boolean padding mask ``(B, M)``, ``True`` for real tokens (self-attention: it masks the queries
        too); the comparison then uses each sequence's real tokens only.
    :param random_samples: Random frames per sequence and head for ``random_left_cosine``, ``random_right_cosine``
        and ``random_max_angle`` (Monte Carlo; ``random_kernel_error`` is exact).
    :param seed: Seed of the random frames (a generator of its own: the global RNG is not touched).
    :return: A :class:`KSVDFidelity` with fields of shape ``(B, H)``.
    :raises TypeError: Tokens that are not floating tensors of the features' dtype, or a mask that is not boolean.
    :raises ValueError: Tokens of another shape, device or batch size, with a NaN or an infinity, a mask of another
        shape, or a sequence with fewer real queries or keys than the layer's rank :math:`s` (the exact KSVD of an
        ``N x M`` kernel has at most :math:`\min(N, M)` singular pairs).

    .. note:: Cost: the features' forward pass plus the dense kernel, O(N M p) per head, its SVD, O(N M min(N, M)),
        and per random frame two SVDs of O((N + M) s^2).
    """
    module = features if isinstance(features, AttentionKernelEigenFeatures) else getattr(features, "features", None)
    if not isinstance(module, AttentionKernelEigenFeatures):
        raise TypeError(
            "ksvd_fidelity: expected AttentionKernelEigenFeatures or a layer holding them as .features (KEP-SVGP, "
            f"Primal-Attention), got {type(features).__name__}"
        )
    check_int("random_samples", random_samples, where="ksvd_fidelity")
    seed = check_seed("seed", seed, where="ksvd_fidelity")
    _check_inputs(module, queries, keys, key_mask)
    keys = queries if keys is None else keys
    row_mask = key_mask if keys is queries else None  # self-attention: the mask masks the queries too
    rank = module.num_inducing
    _check_lengths(queries, keys, key_mask, row_mask, rank)
    matrix, left_scores, right_scores, singular_values, active, objective_value = _evaluated(
        module, queries, keys, key_mask, row_mask
    )

    left, sigma, right_h = torch.linalg.svd(matrix, full_matrices=False)  # the exact SVD: H_e, sigma, H_r^T
    total = sigma.pow(2).sum(-1).clamp_min(torch.finfo(sigma.dtype).tiny)  # ||K||_F^2: (B, H)
    top = sigma[..., :rank]  # (B, H, s)
    kernel_active = numerically_nonzero(top, max(matrix.shape[-2:]))  # the k numerically nonzero of the top s
    count = kernel_active.sum(-1)  # k: (B, H)
    left_reference = left[..., :rank] * kernel_active.unsqueeze(-2).to(left.dtype)
    right_reference = right_h.mT[..., :rank] * kernel_active.unsqueeze(-2).to(left.dtype)

    left_cosine, left_smallest = _subspace_agreement(_span(left_scores, active), left_reference, count)
    right_cosine, right_smallest = _subspace_agreement(_span(right_scores, active), right_reference, count)
    max_angle = torch.rad2deg(torch.arccos(torch.minimum(left_smallest, right_smallest)))

    # the learned values sorted (inactive ones last) against the exact top s, over the layer's active directions
    learned = torch.where(active, singular_values, -torch.inf).sort(dim=-1, descending=True).values
    compared = torch.arange(rank, device=matrix.device) < active.sum(-1, keepdim=True)
    value_error = torch.where(compared, learned - top, 0.0).norm(dim=-1) / torch.where(compared, top, 0.0).norm(dim=-1)

    approximation = (left_scores / singular_values.unsqueeze(-2)) @ right_scores.mT  # K_hat = e Lambda^-1 r^T
    kernel_error = ((matrix - approximation).pow(2).sum((-2, -1)) / total).sqrt()
    kernel_scale = (approximation.pow(2).sum((-2, -1)) / total).sqrt()
    optimal_error, energy, effective_rank = _spectrum_measures(sigma, rank)

    inverse = torch.where(active, singular_values.reciprocal(), 0.0).unsqueeze(-2)
    terms = 0.5 * ((left_scores.pow(2) * inverse).sum((-2, -1)) + (right_scores.pow(2) * inverse).sum((-2, -1)))
    objective = objective_value.abs() / terms.clamp_min(torch.finfo(terms.dtype).tiny)
    random_left, random_right, random_angle = _random_cosines(
        left_reference, right_reference, count, active, row_mask, key_mask, random_samples, seed
    )
    # E ||Q^T K V||_F^2 = (a / N)(a / M) ||K||_F^2 for independent Haar frames with a columns (E Q Q^T = (a / N) I), and
    # ||K - Q Q^T K V V^T||_F^2 = ||K||_F^2 - ||Q^T K V||_F^2: the expected squared relative error, whatever K is
    queries_real, keys_real = (_real_counts(queries, row_mask), _real_counts(keys, key_mask))
    columns = active.sum(-1).to(matrix.dtype)
    random_error = (1.0 - columns.square() / (queries_real * keys_real)).clamp_min(0.0).sqrt()
    return KSVDFidelity(
        relative_objective=objective,
        left_cosine=left_cosine,
        right_cosine=right_cosine,
        max_angle=max_angle,
        singular_value_error=value_error,
        kernel_error=kernel_error,
        kernel_scale=kernel_scale,
        optimal_error=optimal_error,
        energy=energy,
        effective_rank=effective_rank,
        random_left_cosine=random_left,
        random_right_cosine=random_right,
        random_max_angle=random_angle,
        random_kernel_error=random_error,
    )


def _real_counts(tokens: Tensor, mask: Tensor | None) -> Tensor:
    # the real tokens of every sequence, shape (B, 1) (against (B, H))
    if mask is None:
        return torch.full((tokens.shape[0], 1), tokens.shape[-2], dtype=tokens.dtype, device=tokens.device)
    return mask.sum(-1, keepdim=True).to(tokens.dtype)


def _check_inputs(
    module: AttentionKernelEigenFeatures, queries: Tensor, keys: Tensor | None, key_mask: Tensor | None
) -> None:
    # the checks an attention layer makes before calling its features (which take checked tokens): O(1) plus one
    # elementwise pass per token tensor (finiteness)
    where, reference = "ksvd_fidelity", next(module.parameters())
    for name, tokens, length in [("queries", queries, "N"), ("keys", keys, "M")][: 1 if keys is None else 2]:
        shape, meaning = ("B", length, module.embed_dim), f"(batch, {name}, embed_dim)"
        check_tensor(
            name,
            tokens,
            shape,
            floating=True,
            non_empty=True,
            like=reference,
            finite=True,
            meaning=meaning,
            where=where,
        )
    keys = queries if keys is None else keys
    if keys.shape[0] != queries.shape[0]:
        raise ValueError(
            f"{where}: keys must match queries in batch size, got keys {tuple(keys.shape)} for queries "
            f"{tuple(queries.shape)}"
        )
    if key_mask is not None:
        if not isinstance(key_mask, Tensor) or key_mask.dtype != torch.bool:
            got = key_mask.dtype if isinstance(key_mask, Tensor) else type(key_mask).__name__
            raise InputTypeError(f"{where}: expected a boolean key_mask (True = real token), got {got}")
        shape = tuple(keys.shape[:2])
        check_tensor("key_mask", key_mask, shape, like=keys, match_dtype=False, meaning="(batch, keys)", where=where)


def _check_lengths(queries: Tensor, keys: Tensor, key_mask: Tensor | None, row_mask: Tensor | None, rank: int) -> None:
    # every sequence needs at least s real queries and keys: an N x M kernel has min(N, M) singular pairs
    queries_real, keys_real = int(_real_counts(queries, row_mask).min()), int(_real_counts(keys, key_mask).min())
    if min(queries_real, keys_real) < rank:
        raise ValueError(
            f"ksvd_fidelity: a sequence has N = {queries_real} real queries and M = {keys_real} real keys, fewer "
            f"than the layer's rank s = {rank}: the exact KSVD of an N x M kernel has min(N, M) singular pairs, so "
            "its top-s subspace does not exist; measure on sequences of at least s tokens"
        )
