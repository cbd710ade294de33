"""Base class of the asymmetric kernels."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from gpytorch.constraints import Positive
from gpytorch.module import Module
from torch import Tensor

from ..validation import InputTypeError, broadcastable, check_bool, check_int, check_tensor, initialize_positive


def check_batch_shape(value: object, where: str) -> torch.Size:
    """A batch shape of independent kernels: a ``torch.Size`` or a sequence of positive integers (NumPy integers too).

    :raises InputTypeError: For something that is not a sequence of integers (e.g. a bare ``int``).
    :raises ValueError: For a size < 1.
    """
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise InputTypeError(
            f"{where}: expected batch_shape to be a torch.Size or a sequence of positive integers, got {value!r}"
        )
    return torch.Size(check_int(f"batch_shape[{index}]", size, where=where) for index, size in enumerate(value))


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
    :raises InputTypeError: For a non-integer ``input_dim``, a ``batch_shape`` that is not a sequence of integers, or a
        ``tie`` that is not a bool.
    :raises ValueError: For ``input_dim < 1`` or a batch size < 1.
    """

    has_primal_features: bool = False

    def __init__(self, input_dim: int, tie: bool = False, batch_shape: torch.Size = torch.Size()):
        super().__init__()
        self.input_dim = check_int("input_dim", input_dim, where=type(self).__name__)
        self.tie = check_bool("tie", tie, where=type(self).__name__)
        self.batch_shape = check_batch_shape(batch_shape, type(self).__name__)
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
        initialize_positive(self, "raw_outputscale", "outputscale", value, type(self).__name__)

    def _check_tokens(self, tokens: Tensor, name: str, finite: bool = False, batched: bool = True) -> None:
        # O(1), plus one elementwise pass with finite=True (the dense path only: the feature maps run inside the
        # attention layers, which check their inputs once). Kernels with projections W_q (W_k) need tokens of their
        # dtype (a matrix product does not promote); others promote mixed dtypes elementwise. batched: the tokens'
        # batch dimensions broadcast with batch_shape (not for tokens shared by every kernel, as feature_columns')
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
        if batched and not broadcastable(tokens.shape[:-2], self.batch_shape):
            raise ValueError(
                f"{type(self).__name__}: the batch dimensions of {name} {tuple(tokens.shape[:-2])} do not broadcast "
                f"with the kernel's batch_shape {tuple(self.batch_shape)} (shape (*batch, n, d), *batch broadcasting "
                "with batch_shape)"
            )

    def _register_projections(self, feature_dim: int, in_dim: int) -> None:
        # W_q (and W_k unless tied), shape (*batch_shape, p, in_dim), uniform(+-1/sqrt(in_dim)) as nn.Linear
        self.feature_dim = check_int("feature_dim", feature_dim, where=type(self).__name__)
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
        :raises InputTypeError: For a non-tensor, a non-floating dtype, or a dtype other than the projections'.
        :raises ValueError: For a wrong token dimension, NaN or Inf, or batch dimensions of ``x`` and ``z`` that do
            not broadcast with each other and with ``batch_shape``.
        """
        self._check_tokens(x, "x", finite=True)
        if z is None or z is x:
            z = x
        else:
            self._check_tokens(z, "z", finite=True)
            if not broadcastable(x.shape[:-2], z.shape[:-2]):
                raise ValueError(
                    f"{type(self).__name__}: the batch dimensions of x {tuple(x.shape[:-2])} and z "
                    f"{tuple(z.shape[:-2])} do not broadcast"
                )
        return super().__call__(x, z)

    def query_features(self, x: Tensor) -> Tensor:
        r""":math:`\Phi_q`, shape ``(*batch, N, p)``: ``kernel(x, z) == query_features(x) @ key_features(z).mT``."""
        raise NotImplementedError(f"{type(self).__name__} has no finite primal feature map; use the dual path")

    def key_features(self, z: Tensor) -> Tensor:
        r""":math:`\Phi_k`, shape ``(*batch, M, p)``."""
        raise NotImplementedError(f"{type(self).__name__} has no finite primal feature map; use the dual path")
