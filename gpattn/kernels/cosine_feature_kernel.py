"""The cosine (primal) kernel of KEP-SVGP and Primal-Attention."""

from __future__ import annotations

import torch
from torch import Tensor

from .._torch_compat import values_unreadable
from ..validation import all_finite, check_choice
from .asymmetric_kernel import AsymmetricKernel
from .feature_lift import FeatureLift


def inverse_norms(vectors: Tensor, dim: int) -> Tensor:
    r""":math:`1 / \max(\|v\|, 10^{-12})` along ``dim`` (kept as a size-1 dimension), as
    :func:`torch.nn.functional.normalize` divides, but without its overflow: the squared norm of entries beyond about
    :math:`10^{19}` overflows float32 and ``normalize`` then returns zeros (a cosine kernel of zeros, so an attention
    layer would return its bias alone). Such vectors are rescaled by their largest entry first; the common case costs
    one pass and a check of the (small) vector of squared norms. While compiling or capturing a CUDA graph, where no
    value can be read, every call takes the rescaled path.

    :param vectors: shape ``(..., p, ...)``, ``p`` along ``dim``.
    :param dim: The dimension of the vector entries.
    :return: shape ``(..., 1, ...)``.
    """
    squared = vectors.pow(2).sum(dim, keepdim=True)
    if not values_unreadable() and all_finite(squared):  # else no read: the safe path
        return squared.clamp_min(1e-24).rsqrt()
    scale = vectors.abs().amax(dim, keepdim=True).clamp_min(torch.finfo(vectors.dtype).tiny)
    norms = (vectors / scale).pow(2).sum(dim, keepdim=True).sqrt() * scale
    return norms.clamp_min(1e-12).reciprocal()


class CosineFeatureKernel(AsymmetricKernel):
    r"""Cosine kernel between normalised query and key projections.

    .. math::

        \phi_q(x) = \sqrt{\sigma_f}\, \frac{W_q g(x)}{\|W_q g(x)\|}, \qquad
        \phi_k(z) = \sqrt{\sigma_f}\, \frac{W_k g(z)}{\|W_k g(z)\|}, \qquad
        \kappa(x, z) = \langle \phi_q(x), \phi_k(z) \rangle,

    so :math:`K = \Phi_q \Phi_k^\top` has rank at most ``feature_dim`` and is never formed in the primal path.
    :math:`g` is an optional :class:`~gpattn.kernels.FeatureLift` (identity by default). With ``tie=True``,
    :math:`W_q = W_k` and :math:`K` is symmetric PSD.

    :param input_dim: Token dimension :math:`d`.
    :param feature_dim: Feature dimension :math:`p`.
    :param tie: Share :math:`W_q = W_k` (symmetric limit).
    :param lift: ``"none"``, ``"rff"`` or ``"mlp"`` (see :class:`~gpattn.kernels.FeatureLift`).
    :param lift_dim: Output dimension of the lift.
    :param lift_lengthscale: Initial lengthscale of the random Fourier lift.
    :param batch_shape: Batch of independent kernels (``W_q``, ``W_k`` get shape ``(*batch_shape, p, D)``).
    :param seed: Seed of the random Fourier lift.

    .. note:: Cost O(N D p) for the features, O(N M p) for the dense matrix.
    """

    has_primal_features = True

    def __init__(
        self,
        input_dim: int,
        feature_dim: int,
        tie: bool = False,
        lift: str = "none",
        lift_dim: int = 64,
        lift_lengthscale: float = 1.0,
        batch_shape: torch.Size = torch.Size(),
        seed: int = 0,
    ):
        super().__init__(input_dim, tie=tie, batch_shape=batch_shape)
        self.lift = FeatureLift(lift, input_dim, lift_dim, lift_lengthscale, seed)
        self._register_projections(feature_dim, self.lift.output_dim)

    def _project(self, tokens: Tensor, weight: Tensor) -> Tensor:
        lifted = self.lift(tokens)
        if len(self.batch_shape) == 1 and lifted.dim() >= 3 and lifted.shape[-3] == 1:
            # tokens shared by all heads (..., 1, n, D): one GEMM against the stacked (H p, D) weights instead of a
            # broadcast batched matmul that copies the tokens once per head
            heads, features = weight.shape[0], weight.shape[1]
            flat = lifted.squeeze(-3) @ weight.reshape(heads * features, -1).mT  # shape: (..., n, H p)
            projected = flat.unflatten(-1, (heads, features)).movedim(-2, -3)  # shape: (..., H, n, p)
        else:
            projected = lifted @ weight.mT  # shape: (*batch, n, p)
        normalised = projected * inverse_norms(projected, dim=-1)
        return normalised * self.outputscale.sqrt()[..., None, None]

    def feature_columns(self, tokens: Tensor, side: str = "query") -> tuple[Tensor, Tensor]:
        r"""The features of tokens shared by a batch of kernels (e.g. attention heads), in column layout and
        unnormalised: :math:`\Phi^\top = \sqrt{\sigma_f}\, P \operatorname{diag}(\nu)` with the projections
        :math:`P = W g(X)^\top` and the inverse norms :math:`\nu_i = 1 / \|P_{:, i}\|`.

        Callers fold :math:`\nu` and :math:`\sqrt{\sigma_f}` into the (smaller) matrices the features multiply, so
        the normalised ``(n, p)`` features are never materialised; the column layout makes every later product a
        plain batched GEMM without copies.

        :param tokens: ``(B, n, d)``, the same tokens for every kernel of the batch.
        :param side: ``"query"`` (:math:`W_q`) or ``"key"`` (:math:`W_k`).
        :return: :math:`P`, shape ``(B, *batch_shape, p, n)``, contiguous; :math:`\nu`, shape
            ``(B, *batch_shape, 1, n)``.
        :raises ValueError: For another ``side``, or tokens not of shape ``(B, n, d)``.

        .. note:: One GEMM ``(batch p, D) x (D, n)`` per sequence and one pass over :math:`P`: O(n D p batch).
        """
        check_choice("side", side, ("query", "key"), where="CosineFeatureKernel.feature_columns")
        weight = self.query_weight if side == "query" else self.key_projection  # shape: (H, p, D)
        return self._columns(tokens, weight, "feature_columns")

    def paired_feature_columns(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        r"""The query and the key features of the same tokens (self-attention) as the halves of one tensor:
        :math:`[P_q; P_k]` with :math:`P = W g(X)^\top` and their inverse norms :math:`[\nu_q; \nu_k]`, as
        :meth:`feature_columns` gives each (for an untied kernel; a tied one gives two equal halves).

        :param tokens: ``(B, n, d)``.
        :return: :math:`[P_q; P_k]`, shape ``(B, 2, *batch_shape, p, n)``, contiguous; :math:`[\nu_q; \nu_k]`, shape
            ``(B, 2, *batch_shape, 1, n)``.

        .. note:: One GEMM ``(2 batch p, D) x (D, n)`` per sequence and one pass over both halves: the cost of two
            :meth:`feature_columns` calls in half their operators.
        """
        weight = torch.stack([self.query_weight, self.key_projection])  # shape: (2, H, p, D)
        return self._columns(tokens, weight, "paired_feature_columns")

    def _columns(self, tokens: Tensor, weight: Tensor, where: str) -> tuple[Tensor, Tensor]:
        # P = W g(X)^T for the stacked weights (*stack, p, D) of every kernel, and its inverse column norms
        self._check_tokens(tokens, "tokens", batched=False)
        if tokens.dim() != 3 or len(self.batch_shape) != 1:
            raise ValueError(
                f"{where} needs tokens of shape (B, n, d) and one batch dimension of kernels, got tokens "
                f"{tuple(tokens.shape)} and batch_shape {tuple(self.batch_shape)}"
            )
        lifted = self.lift(tokens)
        # a batched GEMM with the weight broadcast over the sequences writes P contiguous; `weight @ lifted.mT`
        # would be computed as (lifted @ weight^T)^T and leave a transposed view that later products copy
        rows = weight.shape[:-1]  # (*stack, p)
        projected = torch.bmm(weight.reshape(-1, weight.shape[-1]).expand(lifted.shape[0], -1, -1), lifted.mT)
        projected = projected.unflatten(-2, rows)  # shape: (B, *stack, p, n)
        inverse_norm = inverse_norms(projected, dim=-2)
        return projected, inverse_norm

    def query_features(self, x: Tensor) -> Tensor:
        self._check_tokens(x, "x")
        return self._project(x, self.query_weight)

    def key_features(self, z: Tensor) -> Tensor:
        self._check_tokens(z, "z")
        return self._project(z, self.key_projection)

    def forward(self, x: Tensor, z: Tensor) -> Tensor:
        return self.query_features(x) @ self.key_features(z).mT
