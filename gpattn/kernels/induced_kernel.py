"""Symmetric PSD kernels induced by an asymmetric kernel on a landmark set (for exact-GP baselines)."""

from __future__ import annotations

import torch
from gpytorch.kernels import Kernel
from torch import Tensor

from ..validation import check_bool, check_choice, check_tensor
from .asymmetric_kernel import AsymmetricKernel

SIDES = ("left", "right", "both")


class InducedKernel(Kernel):
    r"""The symmetric PSD kernels of the kernel-eigen SVGP pair, as a :class:`gpytorch.kernels.Kernel`.

    With query landmarks :math:`X` and key landmarks :math:`Z` (the same set by default):

    .. math::

        k_e(x, x') = \kappa(x, Z)\, \kappa(x', Z)^\top, \qquad
        k_r(z, z') = \kappa(X, z)^\top \kappa(X, z'),

    the weight-space priors :math:`f_e(x) = \kappa(x, Z) w` and :math:`f_r(z) = \kappa(X, z)^\top w'` with
    :math:`w, w' \sim \mathcal N(0, I)`. ``side="both"`` gives :math:`k_e + k_r`, the prior of the merged
    (``merge="sum"``) output of :class:`~gpattn.models.KernelEigenPairSVGP`. Use it in a
    :class:`gpytorch.models.ExactGP` as the exact reference of the sparse model.

    :param kernel: The asymmetric kernel :math:`\kappa` (shared, not copied).
    :param landmarks: Query landmarks :math:`X`, shape ``(M, d)``.
    :param side: ``"left"``, ``"right"`` or ``"both"``.
    :param key_landmarks: Key landmarks :math:`Z` (default: ``landmarks``).
    :param learn_landmarks: Register the landmarks as parameters.

    .. note:: Cost O(N M p) for the roots and O(N N' M) for the dense matrix (rank at most 2M).
    """

    def __init__(
        self,
        kernel: AsymmetricKernel,
        landmarks: Tensor,
        side: str = "both",
        key_landmarks: Tensor | None = None,
        learn_landmarks: bool = False,
    ):
        super().__init__()
        check_choice("side", side, SIDES, where="InducedKernel")
        learn_landmarks = check_bool("learn_landmarks", learn_landmarks, where="InducedKernel")
        if not isinstance(kernel, AsymmetricKernel):
            raise TypeError(f"InducedKernel: expected an AsymmetricKernel, got {type(kernel).__name__}")
        key_landmarks = landmarks if key_landmarks is None else key_landmarks
        for name, value in (("landmarks", landmarks), ("key_landmarks", key_landmarks)):
            shape = ("...", "M", kernel.input_dim)
            check_tensor(name, value, shape, floating=True, non_empty=True, finite=True, where="InducedKernel")
        self.kernel = kernel
        self.side = side
        # a batch of kernels (the kernel's batch_shape) or of landmark sets: a batch of induced kernels; GPyTorch's lazy
        # kernel tensor checks its shape against batch_shape (left at () it refused the batch, blaming GPyTorch)
        try:
            self.batch_shape = torch.broadcast_shapes(
                kernel.batch_shape, landmarks.shape[:-2], key_landmarks.shape[:-2]
            )
        except RuntimeError as error:
            raise ValueError(
                f"InducedKernel: the kernel's batch_shape {tuple(kernel.batch_shape)} and the batch shapes of the "
                f"landmarks {tuple(landmarks.shape[:-2])} and key_landmarks {tuple(key_landmarks.shape[:-2])} do not "
                "broadcast"
            ) from error
        register = self.register_parameter if learn_landmarks else self.register_buffer
        wrap = torch.nn.Parameter if learn_landmarks else (lambda t: t)
        register("landmarks", wrap(landmarks.detach().clone()))
        register("key_landmarks", wrap(key_landmarks.detach().clone()))

    def root(self, x: Tensor) -> Tensor:
        r"""Feature matrix :math:`R(x)` with :math:`k(x, x') = R(x) R(x')^\top`.

        :return: shape ``(*batch, N, M)`` for one side, ``(*batch, N, 2M)`` for ``"both"``."""
        parts = []
        if self.side in ("left", "both"):
            parts.append(self.kernel(x, self.key_landmarks))  # kappa(x, Z)
        if self.side in ("right", "both"):
            parts.append(self.kernel(self.landmarks, x).mT)  # kappa(X, x)^T
        return torch.cat(parts, dim=-1)

    def forward(self, x1: Tensor, x2: Tensor, diag: bool = False, last_dim_is_batch: bool = False, **params) -> Tensor:
        if last_dim_is_batch:
            raise NotImplementedError("InducedKernel does not support last_dim_is_batch")
        root1 = self.root(x1)
        root2 = root1 if x2 is x1 or torch.equal(x1, x2) else self.root(x2)
        if diag:
            return (root1 * root2).sum(-1)
        return root1 @ root2.mT
