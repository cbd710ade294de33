"""Lifts of low-dimensional tokens before a normalised linear feature map."""

from __future__ import annotations

import math

import torch
from gpytorch.constraints import Positive
from gpytorch.module import Module
from torch import Tensor

from ..validation import MAX_SEED, check_choice, check_int, initialize_positive

LIFTS = ("none", "rff", "mlp")


class FeatureLift(Module):
    r"""A nonlinear map :math:`g: \mathbb R^d \to \mathbb R^D` applied to tokens before :math:`W x / \|W x\|`.

    The cosine kernel :math:`\langle W_q x / \|W_q x\|, W_k z / \|W_k z\|\rangle` is scale invariant, and on
    1-D inputs :math:`W x / \|W x\|` takes two values only: low-dimensional toy inputs need a lift.

    * ``"rff"``: random Fourier features :math:`g(x) = \sqrt{2/D} \cos(\Omega x / \ell + b)` with fixed
      :math:`\Omega \sim \mathcal N(0, I)`, :math:`b \sim \mathcal U(0, 2\pi)` drawn from ``seed`` and a learned
      lengthscale :math:`\ell` (Rahimi & Recht, 2007).
    * ``"mlp"``: :math:`g(x) = \tanh(A x + c)` with learned :math:`A, c`.
    * ``"none"``: the identity (:math:`D = d`).

    :param kind: ``"none"``, ``"rff"`` or ``"mlp"``.
    :param input_dim: :math:`d`.
    :param lift_dim: :math:`D` (ignored for ``"none"``).
    :param lengthscale: initial :math:`\ell` of the random Fourier features.
    :param seed: seed of the random Fourier frequencies (the global RNG is not touched).
    :raises InputTypeError: For a non-integer ``input_dim``, ``lift_dim`` or ``seed``, or a ``lengthscale`` that is
        not a number or a tensor of numbers.
    :raises ValueError: For an unknown ``kind``, sizes < 1, or a ``lengthscale`` <= 0, not finite or not a scalar.

    .. note:: Cost O(N d D) per call.
    """

    def __init__(self, kind: str, input_dim: int, lift_dim: int = 64, lengthscale: float = 1.0, seed: int = 0):
        super().__init__()
        check_choice("lift", kind, LIFTS, where="FeatureLift")
        input_dim = check_int("input_dim", input_dim, where="FeatureLift")
        if kind != "none":
            lift_dim = check_int("lift_dim", lift_dim, where="FeatureLift")
            # torch.Generator.manual_seed takes 64-bit seeds (negative ones too) as Python ints only
            seed = check_int("seed", seed, minimum=-(2**63), maximum=MAX_SEED, where="FeatureLift")
        self.kind = kind
        self.input_dim = input_dim
        self.output_dim = input_dim if kind == "none" else lift_dim
        if kind == "rff":
            generator = torch.Generator().manual_seed(seed)
            # shape: (D, d), (D,)
            self.register_buffer("frequencies", torch.randn(lift_dim, input_dim, generator=generator))
            self.register_buffer("phases", 2 * math.pi * torch.rand(lift_dim, generator=generator))
            self.register_parameter("raw_lengthscale", torch.nn.Parameter(torch.zeros(())))
            self.register_constraint("raw_lengthscale", Positive())
            initialize_positive(self, "raw_lengthscale", "lengthscale", lengthscale, "FeatureLift")
        elif kind == "mlp":
            self.linear = torch.nn.Linear(input_dim, lift_dim)

    @property
    def lengthscale(self) -> Tensor:
        r"""The learned lengthscale :math:`\ell` of the random Fourier lift (``"rff"`` only), a scalar tensor."""
        return self.raw_lengthscale_constraint.transform(self.raw_lengthscale)

    @lengthscale.setter
    def lengthscale(self, value: float | Tensor) -> None:
        # as GPyTorch's kernels: kernel.lengthscale = value, kernel.initialize(lengthscale=value), and the setting of a
        # sampled value by pyro_sample_from_prior for a prior registered on "lengthscale"
        if self.kind != "rff":
            raise AttributeError(f"FeatureLift: a {self.kind!r} lift has no lengthscale (only 'rff' has one)")
        initialize_positive(self, "raw_lengthscale", "lengthscale", value, "FeatureLift")

    def forward(self, x: Tensor) -> Tensor:
        r"""The lifted tokens :math:`g(x)`.

        :param x: Tokens, shape ``(..., N, d)``.
        :return: shape ``(..., N, D)`` (``D = d`` for ``"none"``).
        """
        if self.kind == "rff":
            projection = x @ self.frequencies.to(x).mT / self.lengthscale + self.phases.to(x)
            return math.sqrt(2.0 / self.output_dim) * torch.cos(projection)
        if self.kind == "mlp":
            return torch.tanh(self.linear(x))
        return x
