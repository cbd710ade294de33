"""Base class of the asymmetric kernels."""

from __future__ import annotations

import torch
from gpytorch.constraints import Positive
from gpytorch.module import Module
from torch import Tensor


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
        if not isinstance(input_dim, int) or input_dim < 1:
            raise ValueError(f"expected a positive integer input_dim, got {input_dim!r}")
        self.input_dim = input_dim
        self.tie = bool(tie)
        self.batch_shape = torch.Size(batch_shape)
        self.register_parameter("raw_outputscale", torch.nn.Parameter(torch.zeros(self.batch_shape)))
        self.register_constraint("raw_outputscale", Positive())
        self.initialize(outputscale=1.0)

    @property
    def outputscale(self) -> Tensor:
        # shape: (*batch_shape,)
        return self.raw_outputscale_constraint.transform(self.raw_outputscale)

    @outputscale.setter
    def outputscale(self, value: float | Tensor) -> None:
        value = torch.as_tensor(value, dtype=self.raw_outputscale.dtype, device=self.raw_outputscale.device)
        self.initialize(raw_outputscale=self.raw_outputscale_constraint.inverse_transform(value))

    def _check_tokens(self, tokens: Tensor, name: str) -> None:
        if not isinstance(tokens, Tensor):
            raise TypeError(f"expected {name} to be a torch.Tensor, got {type(tokens).__name__}")
        if tokens.dim() < 2 or tokens.shape[-1] != self.input_dim:
            raise ValueError(f"expected {name} of shape (..., n, {self.input_dim}), got {tuple(tokens.shape)}")
        if not tokens.is_floating_point():
            raise TypeError(f"expected {name} to be a floating-point tensor, got {tokens.dtype}")

    def _register_projections(self, feature_dim: int, in_dim: int) -> None:
        # W_q (and W_k unless tied), shape (*batch_shape, p, in_dim), uniform(+-1/sqrt(in_dim)) as nn.Linear
        if not isinstance(feature_dim, int) or feature_dim < 1:
            raise ValueError(f"expected a positive integer feature_dim, got {feature_dim!r}")
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
        z = x if z is None else z
        self._check_tokens(x, "x")
        self._check_tokens(z, "z")
        return super().__call__(x, z)

    def query_features(self, x: Tensor) -> Tensor:
        r""":math:`\Phi_q`, shape ``(*batch, N, p)``: ``kernel(x, z) == query_features(x) @ key_features(z).mT``."""
        raise NotImplementedError(f"{type(self).__name__} has no finite primal feature map; use the dual path")

    def key_features(self, z: Tensor) -> Tensor:
        r""":math:`\Phi_k`, shape ``(*batch, M, p)``."""
        raise NotImplementedError(f"{type(self).__name__} has no finite primal feature map; use the dual path")
