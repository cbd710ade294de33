"""Base class of the asymmetric kernels."""

from __future__ import annotations

import torch
from gpytorch.constraints import Positive
from gpytorch.module import Module
from torch import Tensor

from ..validation import check_int, check_positive, check_tensor


class AsymmetricKernel(Module):
    r"""A kernel :math:`\kappa(x, z)` between queries :math:`x` and keys :math:`z` with, in general,
    :math:`\kappa(x, z) \neq \kappa(z, x)`.

    Its matrix :math:`K = [\kappa(x_i, z_j)]_{ij}` (shape ``N x M``) is neither symmetric nor positive
    semi-definite, which is why these kernels are not :class:`gpytorch.kernels.Kernel` subclasses (GPyTorch
    treats those as covariance functions). The symmetric PSD kernels that an asymmetric kernel induces on the
    left and right of a landmark set live in :class:`~gpattn.kernels.InducedKernel`.

    Every asymmetric kernel carries a positive ``outputscale`` :math:`\sigma_f` that multiplies the kernel.
    ``kernel(x, z)`` returns the dense matrix (the *dual* path). Kernels with an explicit finite feature map
    (``has_primal_features = True``) also give ``query_features(x)`` and ``key_features(z)`` with
    :math:`K = \Phi_q \Phi_k^\top` (the *primal* path).

    :param input_dim: Dimension :math:`d` of the query and key tokens.
    :param tie: Share the query and key maps (the symmetric limit :math:`\kappa(x, z) = \kappa(z, x)`).
    :param batch_shape: Batch of independent kernels (e.g. attention heads); parameters carry it in front.
    """

    has_primal_features: bool = False

    def __init__(self, input_dim: int, tie: bool = False, batch_shape: torch.Size = torch.Size()):
        super().__init__()
        check_int("input_dim", input_dim, where=type(self).__name__)
        self.input_dim = input_dim
        self.tie = bool(tie)
        self.batch_shape = torch.Size(batch_shape)
        self.register_parameter("raw_outputscale", torch.nn.Parameter(torch.zeros(self.batch_shape)))
        self.register_constraint("raw_outputscale", Positive())
        self.initialize(outputscale=1.0)

    @property
    def outputscale(self) -> Tensor:
        r"""The positive scale :math:`\sigma_f` that multiplies the kernel, shape ``(*batch_shape)``."""
        # shape: (*batch_shape,)
        return self.raw_outputscale_constraint.transform(self.raw_outputscale)

    @outputscale.setter
    def outputscale(self, value: float | Tensor) -> None:
        value = check_positive("outputscale", value, self.raw_outputscale, where=type(self).__name__)
        self.initialize(raw_outputscale=self.raw_outputscale_constraint.inverse_transform(value))

    def _check_tokens(self, tokens: Tensor, name: str, finite: bool = False) -> None:
        # O(1), plus one elementwise pass with finite=True (the dense path only: the feature maps run inside the
        # attention layers, which check their inputs once). Kernels with projections W_q (W_k) need tokens of their
        # dtype (a matrix product does not promote); others promote mixed dtypes elementwise.
        check_tensor(
            name,
            tokens,
            ("...", "n", self.input_dim),
            floating=True,
            like=self.query_weight if "query_weight" in self._parameters else self.raw_outputscale,
            match_dtype="query_weight" in self._parameters,
            finite=finite,
            where=type(self).__name__,
        )

    def _register_projections(self, feature_dim: int, in_dim: int) -> None:
        # W_q (and W_k unless tied), shape (*batch_shape, p, in_dim), uniform(+-1/sqrt(in_dim)) as nn.Linear
        check_int("feature_dim", feature_dim, where=type(self).__name__)
        self.feature_dim = feature_dim
        bound = 1.0 / in_dim**0.5
        shape = (*self.batch_shape, feature_dim, in_dim)
        self.query_weight = torch.nn.Parameter(torch.empty(shape).uniform_(-bound, bound))
        if not self.tie:
            self.key_weight = torch.nn.Parameter(torch.empty(shape).uniform_(-bound, bound))

    @property
    def key_projection(self) -> Tensor:
        """:math:`W_k` (the query weight when tied), shape ``(*batch_shape, p, in_dim)``."""
        return self.query_weight if self.tie else self.key_weight

    def _scale(self, matrix: Tensor) -> Tensor:
        # sigma_f broadcast over the trailing (n, m) dimensions; shape: (*batch, n, m)
        return matrix * self.outputscale[..., None, None]

    def forward(self, x: Tensor, z: Tensor) -> Tensor:
        r"""Dense kernel matrix.

        :param x: Queries, shape ``(*batch, N, d)``.
        :param z: Keys, shape ``(*batch, M, d)``.
        :return: :math:`K = [\kappa(x_i, z_j)]`, shape ``(*batch, N, M)``.
        """
        raise NotImplementedError

    def __call__(self, x: Tensor, z: Tensor | None = None) -> Tensor:
        r"""The checked dense kernel matrix :math:`K = [\kappa(x_i, z_j)]` (``z`` defaults to ``x``).

        :param x: Queries, shape ``(*batch, N, d)``.
        :param z: Keys, shape ``(*batch, M, d)``, or ``None`` for :math:`\kappa(x, x)`.
        :return: shape ``(*batch, N, M)`` (``(*batch, N, N)`` when ``z`` is ``None``).
        """
        self._check_tokens(x, "x", finite=True)
        if z is None or z is x:
            z = x
        else:
            self._check_tokens(z, "z", finite=True)
        return super().__call__(x, z)

    def query_features(self, x: Tensor) -> Tensor:
        r""":math:`\Phi_q`, shape ``(*batch, N, p)``: ``kernel(x, z) == query_features(x) @ key_features(z).mT``."""
        raise NotImplementedError(f"{type(self).__name__} has no finite primal feature map; use the dual path")

    def key_features(self, z: Tensor) -> Tensor:
        r""":math:`\Phi_k`, shape ``(*batch, M, p)``."""
        raise NotImplementedError(f"{type(self).__name__} has no finite primal feature map; use the dual path")
