"""The KSVD objective J of Suykens (2016) and Primal-Attention: the token-sum form and the official code's form."""

from __future__ import annotations

import math

from torch import Tensor

from ..validation import broadcastable, check_choice, check_tensor

FORMS = ("sum", "official")


def ksvd_objective(
    left_scores: Tensor,
    right_scores: Tensor,
    left_weights: Tensor,
    right_weights: Tensor,
    singular_values: Tensor,
    form: str = "sum",
    mask: Tensor | None = None,
    weights_per_position: bool = False,
) -> Tensor:
    r"""The KSVD objective :math:`J`, whose square the KSVD penalty :math:`\eta J^2` drives to zero.

    ``form="sum"`` (default; docs/math.md section 2), per sequence (and head), with token *sums*:

    .. math::

        J = \tfrac12 \sum_i e(x_i)^\top \Lambda^{-1} e(x_i) + \tfrac12 \sum_j r(z_j)^\top \Lambda^{-1} r(z_j)
            - \operatorname{Tr}(W_e^\top W_r).

    :math:`J = 0` at every stationary point (e.g. :math:`W_e = \Phi_k^\top H_r`, :math:`W_r = \Phi_q^\top H_e`);
    :math:`J = 0` is necessary, not sufficient. With ``weights_per_position=True`` (causal attention, where token
    :math:`i` sees the prefix weights :math:`W_{e,i}, W_{r,i}`) the trace term is
    :math:`\frac1N \sum_i \operatorname{Tr}(W_{e,i}^\top W_{r,i})`.

    ``form="official"``: the number the official KEP-SVGP and Primal-Attention code computes for one layer and batch
    (its ``compute_loss`` / ``train_one_epoch``), a scalar:

    .. math::

        J_{\mathrm{off}} = \tfrac12 \operatorname{mean}_{b, h, i} e_{bhi}^\top \Lambda_h^{-1} e_{bhi}
            + \tfrac12 \operatorname{mean}_{b, h, j} r_{bhj}^\top \Lambda_h^{-1} r_{bhj}
            - \operatorname{Tr}\big(\operatorname{mean}_h \tilde W_{e,h}^\top \tilde W_{r,h}\big),

    with means (not sums) over the sequences, heads and tokens, and the trace of the **raw** per-position weights
    :math:`\tilde W_e, \tilde W_r` (``N' x s`` per head) instead of the data weights
    :math:`W_{e|X} = \tilde X^\top \tilde W_e`, :math:`W_{r|X} = \tilde X^\top \tilde W_r` (so it ignores
    :math:`\tilde X \tilde X^\top`). It is not zero at a KSVD stationary point in general; the penalty is
    :math:`\eta J_{\mathrm{off}}^2` with the official :math:`\eta` (1 for the sum merge, 10 for concatenation).

    :param left_scores: :math:`e(X)`, shape ``(*batch, N, s)``.
    :param right_scores: :math:`r(Z)`, shape ``(*batch, M, s)``.
    :param left_weights: :math:`W_e`, shape ``(*batch, p, s)``; ``(*batch, N, p, s)`` with ``weights_per_position``;
        ``form="official"``: the raw :math:`\tilde W_e`, ``(H, N', s)``.
    :param right_weights: :math:`W_r`, likewise.
    :param singular_values: :math:`\Lambda`, shape ``(*batch, s)`` (sum form) or ``(H, s)`` (official form, scores
        ``(B, H, N, s)``), positive.
    :param form: ``"sum"`` or ``"official"``.
    :param mask: ``form="official"``: ``(B, N)`` bool, the real tokens the means run over (self-attention), or
        ``None`` (all). The sum form expects masked scores zeroed by the caller (a mask is refused).
    :param weights_per_position: Sum form with one pair of weights per position (see above; refused with the
        official form).
    :return: :math:`J`, shape ``(*batch)`` (sum form), or a scalar (official form).
    :raises InputTypeError: For an argument that is not a tensor, or a mask that is not boolean.
    :raises ValueError: For an unknown ``form``, an option the form does not read, or shapes that do not match the
        ones above (the rank :math:`s` shared by all five, :math:`p` by the two weights, :math:`N` by the scores and
        the weights per position or the mask, batch dimensions that broadcast; the official form's scores with at
        least ``(B, H, N, s)`` dimensions and weights of exactly ``(H, N', s)``).

    .. note:: Cost O((N + M + p) s), or O(N p s) with weights per position; the shape checks are O(1).
    """
    check_choice("form", form, FORMS, where="ksvd_objective")
    if form == "sum" and mask is not None:  # the sum form reads no mask: refused, not ignored
        raise ValueError(
            "ksvd_objective: mask= is read by form='official' only; for the sum form zero the masked tokens' scores "
            "(their rows of left_scores and right_scores) and pass mask=None"
        )
    if form == "official" and weights_per_position:
        raise ValueError("ksvd_objective: weights_per_position is read by form='sum' only (causal attention)")
    _check_shapes(
        left_scores, right_scores, left_weights, right_weights, singular_values, form, mask, weights_per_position
    )
    if form == "official":
        # the token sums of the squares per head and direction first, (H, s), then one scaled sum: the divisions by
        # Lambda and the counts act on (H, s) tensors, not on the (B, H, N, s) scores (fewer, smaller operators, and
        # fewer again backward)
        # every dimension but the heads (1) and s summed: (B, H, N, s) scores, or (B, H, ..., N, s) with output
        # dimensions (KernelEigenScores.for_outputs), each of which the mean runs over too
        dims = (0, *range(2, left_scores.dim() - 1))
        if mask is None:
            left_sums, right_sums = left_scores.square().sum(dims), right_scores.square().sum(dims)
            left_sums = left_sums / (left_scores.numel() // left_scores.shape[-1])  # mean over (b, h, ..., i)
            right_sums = right_sums / (right_scores.numel() // right_scores.shape[-1])
        else:  # the mean over the real tokens of every sequence and head: the (B, N) mask as (B, 1, ..., N, 1)
            weight = mask.reshape(mask.shape[0], *(1,) * (left_scores.dim() - 3), mask.shape[1], 1)
            weight = weight.to(left_scores.dtype)
            count = weight.sum() * math.prod(left_scores.shape[1:-2])
            left_sums = (left_scores.square() * weight).sum(dims) / count
            right_sums = (right_scores.square() * weight).sum(dims) / count
        trace = (left_weights * right_weights).sum() / left_weights.shape[0]  # Tr(mean_h W~_e^T W~_r)
        values = singular_values.reshape(left_sums.shape)  # (H, s); (H, 1, ..., s) with output dimensions
        return 0.5 * ((left_sums + right_sums) / values).sum() - trace
    inverse = singular_values.reciprocal().unsqueeze(-2)  # shape: (*batch, 1, s)
    left_weighted = left_scores.pow(2) * inverse  # e_ik^2 / lambda_k: (*batch, N, s)
    right_weighted = right_scores.pow(2) * inverse
    coupling = (left_weights * right_weights).sum(dim=(-2, -1))  # Tr(W_e^T W_r)
    if weights_per_position:
        coupling = coupling.mean(-1)
    return 0.5 * (left_weighted.sum(dim=(-2, -1)) + right_weighted.sum(dim=(-2, -1))) - coupling


def _check_shapes(
    left_scores: Tensor,
    right_scores: Tensor,
    left_weights: Tensor,
    right_weights: Tensor,
    singular_values: Tensor,
    form: str,
    mask: Tensor | None,
    weights_per_position: bool,
) -> None:
    # O(1): the shapes of ksvd_objective's arguments, which would otherwise broadcast into a wrong J (a rank-1 weight
    # against rank-s ones, 2-D official weights whose rows the trace would average as heads) or fail in torch's words
    official = form == "official"
    rows = 3 if official or weights_per_position else 2  # the weights' own dimensions, after their batch ones
    if _shapes_fit(left_scores, right_scores, left_weights, right_weights, singular_values, official, rows, mask):
        return  # the common case, without building the messages below
    where = "ksvd_objective"
    if official:
        for name, scores in (("left_scores", left_scores), ("right_scores", right_scores)):
            check_tensor(name, scores, ("...", "N", "s"), where=where)
            if scores.dim() < 4:
                raise ValueError(
                    f"ksvd_objective: form='official' expects {name} of shape (B, H, N, s) (B sequences, H heads), "
                    f"got {tuple(scores.shape)}"
                )
    else:
        check_tensor("left_scores", left_scores, ("...", "N", "s"), where=where)
    rank = left_scores.shape[-1]
    check_tensor("right_scores", right_scores, ("...", "M", rank), where=where)
    check_tensor("singular_values", singular_values, ("...", rank), where=where)
    if official:
        weight_shape = ("H", "N'", rank)
    elif weights_per_position:
        weight_shape = ("...", left_scores.shape[-2], "p", rank)
    else:
        weight_shape = ("...", "p", rank)
    check_tensor("left_weights", left_weights, weight_shape, where=where)
    check_tensor("right_weights", right_weights, (*weight_shape[:-rows], *left_weights.shape[-rows:]), where=where)
    if official:
        if mask is not None:
            batch, tokens = left_scores.shape[0], left_scores.shape[-2]
            check_tensor("mask", mask, (batch, tokens), meaning="(B, N), the scores' sequences and tokens", where=where)
            if right_scores.shape[-2] != tokens:  # one mask for both: self-attention
                raise ValueError(
                    "ksvd_objective: a mask needs left_scores and right_scores of the same tokens (self-attention), "
                    f"got shapes {tuple(left_scores.shape)} and {tuple(right_scores.shape)}"
                )
        return
    batches = (left_scores.shape[:-2], right_scores.shape[:-2], singular_values.shape[:-1])
    batches += (left_weights.shape[:-rows], right_weights.shape[:-rows])
    if not broadcastable(*batches):
        raise ValueError(
            "ksvd_objective: the batch dimensions of left_scores, right_scores, singular_values, left_weights and "
            f"right_weights do not broadcast: {', '.join(str(tuple(batch)) for batch in batches)}"
        )


def _shapes_fit(
    left_scores: Tensor,
    right_scores: Tensor,
    left_weights: Tensor,
    right_weights: Tensor,
    singular_values: Tensor,
    official: bool,
    rows: int,
    mask: Tensor | None,
) -> bool:
    # _check_shapes's conditions as integer comparisons (a few microseconds, a tenth of its messages' cost)
    tensors = (left_scores, right_scores, left_weights, right_weights, singular_values)
    if not all(isinstance(tensor, Tensor) for tensor in tensors):
        return False
    left, right, left_w, right_w, values = (tensor.shape for tensor in tensors)
    least = 4 if official else 2  # the scores' dimensions: (B, H, N, s), or (*batch, N, s)
    if len(left) < least or len(right) < least or not values or len(left_w) < rows or len(right_w) < rows:
        return False
    rank = left[-1]
    if right[-1] != rank or values[-1] != rank or left_w[-1] != rank or right_w[-rows:] != left_w[-rows:]:
        return False
    if official:
        return len(left_w) == 3 and (
            mask is None or (isinstance(mask, Tensor) and mask.shape == (left[0], left[-2]) and right[-2] == left[-2])
        )
    if rows == 3 and left_w[-3] != left[-2]:  # one pair of weights per position of the scores
        return False
    return broadcastable(left[:-2], right[:-2], values[:-1], left_w[:-rows], right_w[:-rows])


def ksvd_objective_from_sums(squared_scores: Tensor, coupling: Tensor, singular_values: Tensor) -> Tensor:
    r"""The sum-form KSVD objective :math:`J` (:func:`ksvd_objective`, ``form="sum"``) from its token sums, for
    callers that have them already (the paired primal-token path forms them in one reduction):

    .. math::

        J = \tfrac12 \sum_k \lambda_k^{-1} S_k - \operatorname{Tr}(W_e^\top W_r), \qquad
        S_k = \sum_i e_{ik}^2 + \sum_j r_{jk}^2.

    :param squared_scores: :math:`S`, shape ``(*batch, s)`` (the masked tokens left out of the sums).
    :param coupling: :math:`\operatorname{Tr}(W_e^\top W_r)`, shape ``(*batch)``.
    :param singular_values: :math:`\Lambda`, shape ``(*batch, s)`` (broadcastable), positive.
    :return: :math:`J`, shape ``(*batch)``.

    .. note:: Cost O(s) per sequence and head.
    """
    return 0.5 * (squared_scores / singular_values).sum(-1) - coupling


def official_objective_from_sums(
    squared_scores: Tensor, singular_values: Tensor, count: int | Tensor, left_weights: Tensor, right_weights: Tensor
) -> Tensor:
    r"""The official code's KSVD objective :math:`J_{\mathrm{off}}` (:func:`ksvd_objective`, ``form="official"``)
    from the token sums of the squared scores, for callers that formed them already (the paired primal-token path):

    .. math::

        J_{\mathrm{off}} = \frac{1}{2 n} \sum_{b, h, k} \lambda_{hk}^{-1} S_{bhk}
            - \operatorname{Tr}\big(\operatorname{mean}_h \tilde W_{e,h}^\top \tilde W_{r,h}\big),

    where :math:`n` counts the positions the official means run over (the tokens of every sequence and head).

    :param squared_scores: :math:`S`, shape ``(B, H, s)``: per sequence and head, the sums over the counted tokens of
        :math:`e_{ik}^2` plus those of :math:`r_{jk}^2`.
    :param singular_values: :math:`\Lambda`, shape ``(H, s)``, positive.
    :param count: :math:`n`, the number of (sequence, head, token) positions of each mean.
    :param left_weights: The raw :math:`\tilde W_e`, ``(H, N', s)``.
    :param right_weights: The raw :math:`\tilde W_r`, likewise.
    :return: A scalar.

    .. note:: Cost O(B H s + H N' s).
    """
    trace = (left_weights * right_weights).sum() / left_weights.shape[0]  # Tr(mean_h W~_e^T W~_r)
    return 0.5 * (squared_scores / singular_values).sum() / count - trace
