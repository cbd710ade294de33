"""A directional (shifted) RBF kernel for low-dimensional toy problems."""

from __future__ import annotations

import torch
from gpytorch.constraints import Positive
from torch import Tensor

from ..validation import InputTypeError, initialize_positive
from .asymmetric_kernel import AsymmetricKernel


class ShiftedRBFKernel(AsymmetricKernel):
    r"""Directional RBF kernel with a learned shift :math:`\delta`.

    .. math::

        \kappa(x, z) = \sigma_f \exp\!\left(-\tfrac12 \|(x - z - \delta) / \ell\|^2\right),

    with ARD lengthscales :math:`\ell \in \mathbb R^d_{>0}`. Since
    :math:`\kappa(z, x) = \sigma_f \exp(-\tfrac12 \|(x - z + \delta)/\ell\|^2)`, the kernel is asymmetric
    whenever :math:`\delta \neq 0`: query :math:`x` responds most to the key at :math:`x - \delta`. With
    ``tie=True`` the shift is fixed at zero (the symmetric RBF). Dual path only.

    :param input_dim: Token dimension :math:`d`.
    :param tie: Fix :math:`\delta = 0`.
    :param shift: Initial shift (scalar or length ``d``).
    :param lengthscale: Initial lengthscale.
    :param batch_shape: Batch of independent kernels.
    :raises InputTypeError: For a ``shift`` or ``lengthscale`` that is not a number or a tensor of numbers.
    :raises ValueError: For a ``lengthscale`` <= 0 or not finite, a non-finite ``shift``, or either of a shape that
        does not fit ``(*batch_shape, d)``.

    .. note:: Cost O(N M d).
    """

    def __init__(
        self,
        input_dim: int,
        tie: bool = False,
        shift: float | Tensor = 0.1,
        lengthscale: float = 1.0,
        batch_shape: torch.Size = torch.Size(),
    ):
        super().__init__(input_dim, tie=tie, batch_shape=batch_shape)
        self.register_parameter("raw_lengthscale", torch.nn.Parameter(torch.zeros(*self.batch_shape, input_dim)))
        self.register_constraint("raw_lengthscale", Positive())
        initialize_positive(self, "raw_lengthscale", "lengthscale", lengthscale, type(self).__name__)
        if not self.tie:
            try:
                initial_shift = torch.as_tensor(shift, dtype=torch.get_default_dtype())
            except (TypeError, ValueError, RuntimeError) as error:
                raise InputTypeError(
                    f"ShiftedRBFKernel: expected shift to be a number or a tensor of numbers, got {shift!r}"
                ) from error
            shape = (*self.batch_shape, input_dim)
            try:
                initial_shift = initial_shift.expand(shape)
            except RuntimeError:
                raise ValueError(
                    f"ShiftedRBFKernel: expected shift to be a number or a tensor broadcastable to {shape}, got shape "
                    f"{tuple(initial_shift.shape)}"
                ) from None
            if not torch.isfinite(initial_shift).all():
                raise ValueError(f"ShiftedRBFKernel: expected a finite shift, got {shift!r}")
            self.shift = torch.nn.Parameter(initial_shift.clone())

    @property
    def lengthscale(self) -> Tensor:
        r"""The ARD lengthscales :math:`\ell`, shape ``(*batch_shape, d)``."""
        # shape: (*batch_shape, d)
        return self.raw_lengthscale_constraint.transform(self.raw_lengthscale)

    @lengthscale.setter
    def lengthscale(self, value: float | Tensor) -> None:
        # as GPyTorch's kernels: kernel.lengthscale = value, kernel.initialize(lengthscale=value), and the setting of a
        # sampled value by pyro_sample_from_prior for a prior registered on "lengthscale"
        initialize_positive(self, "raw_lengthscale", "lengthscale", value, type(self).__name__)

    def forward(self, x: Tensor, z: Tensor) -> Tensor:
        lengthscale = self.lengthscale[..., None, :]
        queries = x if self.tie else x - self.shift[..., None, :]
        queries, keys = queries / lengthscale, z / lengthscale
        # ||a - b||^2 for a in queries, b in keys; shape: (*batch, N, M)
        sq_dist = (queries.unsqueeze(-2) - keys.unsqueeze(-3)).pow(2).sum(-1)
        return self._scale(torch.exp(-0.5 * sq_dist))
