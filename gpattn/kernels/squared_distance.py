"""Squared Euclidean distances between two sets of points, stable at any offset their dtype can represent, and the
origin on which attention layers centre their tokens."""

from __future__ import annotations

import torch
from torch import Tensor


def squared_distance(left: Tensor, right: Tensor, same: bool = False) -> Tensor:
    r"""Squared distances :math:`D_{ij} = \lVert a_i - b_j \rVert^2` by one matrix product, as GPyTorch's
    ``sq_dist``:

    .. math::

        D_{ij} = \lVert a_i - c \rVert^2 + \lVert b_j - c \rVert^2 - 2 \langle a_i - c, b_j - c \rangle,
        \qquad c = \tfrac1n \textstyle\sum_i a_i,

    clamped at 0. The expansion cancels: its rounding error is about :math:`\varepsilon (\lVert a_i - c \rVert^2 +
    \lVert b_j - c \rVert^2)`, so the distances are translation invariant only after the centring by :math:`c`
    (without it a constant offset :math:`t` adds an error :math:`\varepsilon \lVert t \rVert^2`: 0.018 relative in
    an RBF attention's output at :math:`t = 10^3` in float32). With ``same=True`` (``right`` is ``left``) the
    diagonal is exactly 0, as it must be at any scale: the expansion's own diagonal is off by
    :math:`\varepsilon \lVert a_i - c \rVert^2`, which matters once the points spread beyond
    :math:`\varepsilon^{-1/2}` lengthscales (a kernel :math:`e^{-D/2}` then reads 0 instead of 1).

    Tokens are centred before their projections by the layers that use this function (the projection of a token at
    offset :math:`t` already carries an error :math:`\varepsilon \lVert t \rVert`); the centring here makes the
    distances of already projected points, e.g. learned inducing points, independent of where they lie.

    :param left: :math:`a`, shape ``(..., n, p)``.
    :param right: :math:`b`, shape ``(..., m, p)`` (batch dimensions broadcast with ``left``'s).
    :param same: ``right`` is ``left`` (the same tensor object): zero the diagonal.
    :return: :math:`D`, shape ``(..., n, m)``, non-negative.
    :raises ValueError: For points of different dimensions ``p``, or ``same=True`` with a ``right`` that is not
        ``left`` (its distances would be ``left``'s own).

    .. note:: Cost O(n m p) for the product, O((n + m) p) for the centring and the norms.
    """
    if same and right is not left:  # O(1): the self-distances below never read right
        raise ValueError(
            "squared_distance: same=True means right is left (the self-distances of left), got another tensor; pass "
            "same=False for the distances between two sets"
        )
    if left.shape[-1:] != right.shape[-1:]:
        raise ValueError(
            f"squared_distance: expected left (..., n, p) and right (..., m, p) with the same p, got shapes "
            f"{tuple(left.shape)} and {tuple(right.shape)}"
        )
    centre = left.mean(-2, keepdim=True)  # c; shape: (..., 1, p)
    left = left - centre
    right = left if same else right - centre
    squared_dist = left.square().sum(-1, keepdim=True) + right.square().sum(-1).unsqueeze(-2) - 2 * left @ right.mT
    if same:
        squared_dist.diagonal(dim1=-2, dim2=-1).zero_()
    return squared_dist.clamp_min(0)  # clamped against rounding


def first_real_token(tokens: Tensor, mask: Tensor | None = None) -> Tensor:
    """The first real token of every sequence, the origin on which translation-invariant layers centre their tokens
    before projecting them (a causal query always sees it, so the centring reads no later token; padding, which may
    hold anything finite, never moves it).

    :param tokens: shape ``(B, N, C)``.
    :param mask: ``None`` or a boolean ``(B, N)``, ``True`` for real tokens (at least one per sequence).
    :return: shape ``(B, 1, C)``.
    """
    if mask is None:
        return tokens[:, :1]
    first = mask.to(torch.uint8).argmax(-1)  # the first True of every row; shape: (B,)
    return tokens[torch.arange(tokens.shape[0], device=tokens.device), first].unsqueeze(1)


def padding_filled(tokens: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``tokens`` with every padded token replaced by its sequence's first real token, and that token
    (:func:`first_real_token`). Padding may hold anything finite; so filled it moves no mean over the points (the
    centring of :func:`squared_distance`, where padding of 1e4 cost the real tokens all their digits) and no range
    check over them. Without a mask, ``tokens`` as they are.

    :param tokens: shape ``(B, N, C)``.
    :param mask: ``None`` or a boolean ``(B, N)``, ``True`` for real tokens (at least one per sequence).
    :return: The filled tokens ``(B, N, C)`` and the first real tokens ``(B, 1, C)``.

    .. note:: Cost O(B N C) for the replacement (none without a mask).
    """
    first = first_real_token(tokens, mask)
    if mask is None:
        return tokens, first
    return torch.where(mask.unsqueeze(-1), tokens, first), first
