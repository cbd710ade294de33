r"""What an attention layer reads from a kernel-eigen strategy beyond GPyTorch's surface: the strategy's :math:`q(f)`
at the scores of one call, pushed through linear output maps without forming the GP outputs."""

from __future__ import annotations

import functools

import torch
from gpytorch.distributions import MultivariateNormal
from gpytorch.variational import (
    CholeskyVariationalDistribution,
    DeltaVariationalDistribution,
    MeanFieldVariationalDistribution,
)
from torch import Tensor

from .._torch_compat import compilable, is_compiling
from ..features import KernelEigenScores
from ..fused import autocast_state, wide_dtype
from ..validation import broadcastable, check_choice, check_float, check_tensor
from .cholesky_prior_kl import CholeskyPriorKL
from .kernel_eigen_variational_strategy import KernelEigenVariationalStrategy
from .linear_output import LinearOutput
from .marginal_noise import MarginalNoiseOutput, _variance_floor
from .structured_covariance import low_rank_plus_diag, reparameterised_draw

# the autograd functions as torch.compile should meet them (gpattn._torch_compat.compilable: graph breaks before
# torch 2.4)
_linear_output = compilable(LinearOutput.apply)
_cholesky_prior_kl = compilable(CholeskyPriorKL.apply)
_marginal_noise_output = compilable(MarginalNoiseOutput.apply)


def _normal_draws(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Standard normal draws of ``shape`` in ``dtype``, drawn in float32 when ``dtype`` is half precision: the same
    seed then gives the same draw, to the rounding of ``dtype``, with or without autocast (torch's CPU generator draws
    other numbers for bfloat16 than for float32, and which depends on the torch version)."""
    wide = wide_dtype(dtype)
    draws = torch.randn(shape, dtype=wide, device=device)
    return draws if wide == dtype else draws.to(dtype)


class KernelEigenReadout:
    r"""The readout of a kernel-eigen strategy's :math:`q(f)` through linear maps: the one object an attention layer
    holds besides the strategy (docs/math.md section 3).

    An attention layer evaluates its features itself (queries, keys, masks), so it reads the strategy's
    :math:`q(f)` at the :class:`~gpattn.features.KernelEigenScores` of each call rather than calling
    ``strategy(x)``. Its output is linear in the GP outputs, :math:`y = b + \sum_{b, h} F^b_h C^b_h` with per-branch
    maps :math:`C^b` (``(H, d_out, C)``), and :math:`F^b_h = e^b_h \Lambda_h^{-1} u^b_h{}^\top` is linear in
    :math:`u`, so everything the layer needs is one of:

    * :meth:`predictive`: the strategy's :math:`q(f)` of one branch at the call's inputs (mean, covariance root and
      residual: the algebra of the strategy's ``forward``);
    * :meth:`linear_output`: the output under the mean of :math:`q(u)` or a joint reparameterised draw
      :math:`u = m + L \varepsilon` per sequence (:meth:`inducing_draw`'s), the maps folded into ``(s, C)``
      coefficients :math:`\Lambda^{-1} \sum_c u_c C_c` and one output GEMM over the stacked scores
      (:meth:`~gpattn.features.KernelEigenScores.columns`);
    * :meth:`token_noise`: per-input noise (the official code's "marginal" sampling, the residual);
    * :meth:`output_variance`: :math:`\operatorname{Var}(y)` of :math:`q(f)` through the maps;
    * :meth:`kl_divergence`: the KL summed over :math:`q(u)`'s batch, the layer's KL term;
    * :meth:`initialize_at_prior_draw`: the layer's starting :math:`q(u)`.

    The layout is the attention layers': :math:`q(u)` of batch ``(H, d_out)`` (``(H, d_out, 2 or 1)`` for a pair:
    ``num_output_dims=1``), scores of batch ``(B, H)``.

    :param strategy: The strategy (single branch or pair) whose :math:`q(u)` and algebra are read.
    :raises ValueError: A strategy with ``num_output_dims != 1``.

    Example:
        >>> from gpattn.attention import KEPSVGPAttention
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> layer = KEPSVGPAttention(embed_dim=16, num_heads=2, num_inducing=3, num_outputs=4)
        >>> scores = layer.features(torch.randn(5, 9, 16), kernel_diag=False)
        >>> q_f = layer.readout.predictive(scores, "right")  # q(f_r): batch (B, H, d_out) over the N tokens
        >>> q_f.batch_shape, q_f.event_shape
        (torch.Size([5, 2, 4]), torch.Size([9]))
        >>> layer.readout.inducing_draw(torch.Size([5])).shape  # one joint u per sequence: (B, H, d_out, 2, s)
        torch.Size([5, 2, 4, 2, 3])
    """

    def __init__(self, strategy: KernelEigenVariationalStrategy):
        if strategy.num_output_dims != 1:
            raise ValueError(
                f"KernelEigenReadout maps one output dimension of q(u), the strategy has {strategy.num_output_dims}"
            )
        self.strategy = strategy

    # -- q(f) at the scores of a call --------------------------------------------------------------------------------
    def _parts(self, scores: KernelEigenScores, side: str) -> tuple[Tensor, Tensor, Tensor | None]:
        strategy = self.strategy
        variational = strategy.variational_distribution
        mean = strategy._select_branch(variational.mean, side, 1)
        covariance = None if self._point_mass() else variational.lazy_covariance_matrix  # a delta q(u): none
        covariance = strategy._select_branch_covariance(covariance, side)
        return strategy._predictive_parts(scores, side, mean, covariance)

    def _point_mass(self) -> bool:
        # a delta q(u) (GPyTorch's DeltaVariationalDistribution, MAP): a point mass at its mean, without a covariance
        return isinstance(self.strategy._variational_distribution, DeltaVariationalDistribution)

    def predictive(self, scores: KernelEigenScores, side: str) -> MultivariateNormal:
        r""":math:`q(f)` of one branch at the inputs of one call of the features, without the prior mean: a batch
        ``(B, H, d_out)`` of distributions over the ``N`` queries with a low-rank-plus-diagonal covariance (the algebra
        of :meth:`KernelEigenVariationalStrategy.forward`).

        :param scores: The features of the call, scores of shape ``(B, H, N, s)``.
        :param side: ``"left"`` or ``"right"`` (a branch of the strategy).
        """
        mean, root, residual = self._parts(scores, side)
        return MultivariateNormal(mean, low_rank_plus_diag(root, residual))

    def output_variance(self, scores: KernelEigenScores, sides: tuple[str, ...], maps: list[Tensor]) -> Tensor:
        r"""The variance of :math:`y = \sum_b F^b C^b` under :math:`q(f)` (:meth:`predictive`), ``(B, N, C)``: the GP
        outputs are independent across heads and output dimensions, so :math:`\operatorname{Var}(y_{nj}) = \sum_{h, c}
        \| \sum_b C^b_{hcj}\, e^b_n \Lambda^{-1} L_c \|^2 + \sum_{b, h, c} (C^b_{hcj})^2 \rho^b_n` with the residual
        :math:`\rho` (cross-branch terms only when the branches share :math:`q(u)`).

        :param scores: The features of the call.
        :param sides: The branches at the queries.
        :param maps: :math:`C^b` of each side, ``(H, d_out, C)``.
        """
        parts = [self._parts(scores, side) for side in sides]  # root (B, H, d_out, N, s)
        shared = self._shares_posterior(tuple(sides))
        variance = 0.0
        for a, (_, root_a, _) in enumerate(parts):
            for b, (_, root_b, _) in enumerate(parts):
                if a == b or shared:
                    inner = (root_a * root_b).sum(-1)  # (B, H, d_out, N)
                    variance = variance + torch.einsum("bhcn,hcj->bnj", inner, maps[a] * maps[b])
        for (_, _, residual), weight in zip(parts, maps, strict=True):
            if residual is not None:
                variance = variance + torch.einsum("bhcn,hcj->bnj", residual, weight.pow(2))
        return variance

    # -- draws of u and the linear readout --------------------------------------------------------------------------
    def inducing_draw(self, sample_shape: torch.Size | None = None) -> Tensor:
        r"""The mean :math:`m` of :math:`q(u)` (``sample_shape=None``), or joint reparameterised draws
        :math:`u = m + L \varepsilon`, shape ``(*sample_shape, *q_batch, s)`` (of a delta :math:`q(u)`: its mean,
        expanded). Branches that share a posterior share the draw."""
        variational = self.strategy.variational_distribution
        if sample_shape is None:
            return variational.mean
        if self._point_mass():
            return variational.mean.expand(*sample_shape, *variational.mean.shape)
        noise = torch.randn(
            (*sample_shape, *variational.mean.shape), dtype=variational.mean.dtype, device=variational.mean.device
        )
        return reparameterised_draw(variational.mean, variational.lazy_covariance_matrix, noise)

    def linear_output(
        self,
        columns: Tensor,
        bias: Tensor,
        maps: Tensor,
        scores: KernelEigenScores,
        sides: tuple[str, ...],
        batch: int | None = None,
    ) -> Tensor:
        r"""The output :math:`y = b + \sum_b \sum_c F^b_c C^b_c` of the linear maps :math:`C^b` of the GP outputs of the
        branches ``sides``, under the mean of :math:`q(u)` (``batch=None``) or one joint draw
        :math:`u = m + L \varepsilon` per sequence (``batch = B``; the noise drawn as :meth:`inducing_draw` draws it):
        with :math:`F_c(x) = e(x) \Lambda^{-1} u_c` over the output dimension :math:`c`,

        .. math::

            \sum_c F^b_c(x) C^b_c = e^b(x)\, A^b, \qquad A^b = \Lambda^{-1} \textstyle\sum_c u^b_c C^b_c
            \quad (\text{whitened: } \textstyle\sum_c u^b_c C^b_c),

        so that the outputs are never formed: ``(s, C)`` coefficients per branch, head and draw (an inactive
        direction's are zero, as its interpolation column is), then one GEMM with the stacked scores. A Cholesky
        :math:`q(u)` takes one autograd function for the draw, the coefficients and the GEMM
        (:class:`~gpattn.variational.linear_output.LinearOutput`); another draws through :meth:`inducing_draw`.

        :param columns: The stacked scores :math:`[e^\top; r^\top]` of ``sides`` as ``(B, branches H s, N)``
            (:meth:`~gpattn.features.KernelEigenScores.columns` flattened).
        :param bias: :math:`b`, broadcastable to ``(B, N, C)``.
        :param maps: :math:`C`: one map ``(H, d_out, C)`` for every branch, or one per side,
            ``(branches, H, d_out, C)``.
        :param scores: The features of the call (its :math:`\Lambda` and active directions).
        :param sides: The branches, ``("left", "right")`` or a leading part of the strategy's.
        :param batch: The number of sequences to draw for, or ``None`` (the mean).
        :return: ``(B, N, C)``.

        .. note:: Cost O(d_out s C) per branch, head and draw, O(d_out s^2) per draw for :math:`L \varepsilon`,
            O(N branches H s C) per sequence for the GEMM.
        """
        strategy = self.strategy
        if not sides or tuple(sides) != strategy._branch_sides[: len(sides)]:  # () read no branch: y = b alone
            raise ValueError(
                f"{type(self).__name__}: expected the sides {strategy._branch_sides} or a non-empty leading part of "
                f"them, got {tuple(sides)}"
            )
        distribution = strategy._variational_distribution
        if type(distribution) is CholeskyVariationalDistribution:
            mean, factor, noise = distribution.variational_mean, None, None
            if batch is not None:  # the noise as inducing_draw draws it: (B, *q_batch, s)
                factor = distribution.chol_variational_covar
                noise = torch.randn((batch, *mean.shape), dtype=mean.dtype, device=mean.device)
        else:
            draw = self.inducing_draw(None if batch is None else torch.Size([batch]))
            mean, factor, noise = (draw if batch is None else draw.movedim(0, -1)), None, None
        if len(strategy._branch_sides) == 1:  # one q(u): a branch dimension of size 1
            mean, factor = mean.unsqueeze(2), None if factor is None else factor.unsqueeze(2)
            noise = None if noise is None else noise.unsqueeze(3)
        singular_values = None if strategy.whiten else scores.singular_values
        parts = (mean, factor, noise, singular_values, scores.active, maps, len(sides))
        return _linear_output(columns, bias, *parts)

    def kl_divergence(self) -> Tensor:
        r"""The strategy's :math:`\mathrm{KL}(q(u) \| p(u))` (against the features' own :math:`\Lambda`) summed over
        :math:`q(u)`'s batch (heads, outputs, branches), a scalar: one autograd function for a Cholesky :math:`q(u)`
        (:class:`~gpattn.variational.cholesky_prior_kl.CholeskyPriorKL`), else the strategy's KL summed.

        .. note:: Cost O(s^2) per element of :math:`q(u)`'s batch, forward and backward.
        """
        strategy = self.strategy
        distribution = strategy._variational_distribution
        if type(distribution) is CholeskyVariationalDistribution:
            mean, factor = distribution.variational_mean, distribution.chol_variational_covar
            scales = strategy._prior_scales(aligned=False)  # aligned inside the function: no view in the graph
            return _cholesky_prior_kl(mean, factor, scales, True, strategy._aligned_dims)
        return strategy.kl_divergence().sum()

    def initialize_at_prior_draw(self, singular_values: Tensor, covariance_scale: float = 0.1) -> None:
        r"""Set :math:`q(u) = \mathcal N(m_0, c^2 \Lambda^2)` with a draw :math:`m_0 \sim \mathcal N(0, \Lambda^2)` of
        the (unwhitened) prior: :math:`\Lambda^{-1} m_0` then acts like a random projection, so the outputs start
        away from zero, and the posterior starts tighter than the prior (:math:`c` = ``covariance_scale``).

        :param singular_values: The :math:`\Lambda` to scale with, positive and finite, ``(H, s)`` (e.g. ones when the
            prior is per call), or a shape that broadcasts to it (``(s,)``: one :math:`\Lambda` for every head).
        :param covariance_scale: :math:`c > 0`.
        :raises TypeError: A :math:`q(u)` other than a Cholesky or mean-field one, or ``singular_values`` not a
            floating-point tensor.
        :raises ValueError: ``singular_values`` of another shape, not finite or not positive. Nothing is changed then.
        """
        strategy = self.strategy
        where = type(self).__name__
        check_float("covariance_scale", covariance_scale, 0.0, strict_minimum=True, where=where)
        distribution = strategy._variational_distribution
        if not isinstance(distribution, (CholeskyVariationalDistribution, MeanFieldVariationalDistribution)):
            raise TypeError(
                "initialize_at_prior_draw needs a Cholesky or mean-field variational distribution, got "
                f"{type(distribution).__name__}"
            )
        # checked before q(u) is touched: a NaN or a zero would leave a q(u) of NaN or of infinite KL behind
        target = distribution.variational_mean.shape  # (*batch, *outputs[, branches], s)
        lead = tuple(target[: len(target) - 1 - strategy._aligned_dims])
        shape = ("...", target[-1])
        check_tensor("singular_values", singular_values, shape, floating=True, finite=True, where=where)
        aligned = strategy._aligned(singular_values)
        if not broadcastable(aligned.shape, target) or torch.broadcast_shapes(aligned.shape, target) != target:
            raise ValueError(
                f"{where}: expected singular_values of shape {lead + (target[-1],)} (the batch in front of q(u)'s "
                f"outputs, then s) or one that broadcasts to it, got {tuple(singular_values.shape)}"
            )
        if not bool((singular_values > 0).all()):
            raise ValueError(
                f"{where}: expected positive singular_values (the prior scales Lambda), got a minimum of "
                f"{float(singular_values.min()):g}"
            )
        with torch.no_grad():
            scale = aligned.to(distribution.variational_mean).expand_as(distribution.variational_mean)
            distribution.variational_mean.copy_(scale * torch.randn_like(scale))
            if isinstance(distribution, CholeskyVariationalDistribution):
                distribution.chol_variational_covar.copy_(torch.diag_embed(covariance_scale * scale))
            else:
                distribution._variational_stddev.copy_(covariance_scale * scale)
        strategy.variational_params_initialized.fill_(1)

    # -- per-input noise ---------------------------------------------------------------------------------------------
    def token_noise(
        self, scores: KernelEigenScores, sides: tuple[str, ...], marginal: bool, sum_sides: bool = False
    ) -> dict[str, Tensor]:
        r"""Noise of the outputs that is independent across the ``N`` inputs of a call: per-input draws of
        :math:`q(u)` beyond the joint one (``marginal``: noise distributed as :math:`a(x_n) L \varepsilon_n` with
        :math:`a = e \Lambda^{-1}`, exact per-input marginals and no correlation across inputs, the official
        KEP-SVGP code's sampling; branches that share :math:`q(u)` are jointly distributed as with a shared
        :math:`\varepsilon_n`) and the residual :math:`\sqrt{\rho(x_n)}\, \xi_n` (``residual="diag"``, independent
        per branch).

        No :math:`L \varepsilon_n` is formed (an ``(N, d_out, s)`` tensor per sequence): the variance per input
        and output, :math:`v_{nc} = a_n S_c a_n^\top`, comes from one GEMM (:meth:`token_noise_moments`) and the noise
        is :math:`\sqrt{v_{nc}}\, \xi_{nc}`, one standard normal per input and output. Two branches that share
        :math:`q(u)` are correlated at one input (covariance :math:`a^e_n S_c a^r_n{}^\top`) and are drawn from
        their :math:`2 \times 2` covariance by its closed-form Cholesky factor.

        :param scores: The features of the call.
        :param sides: The branches to draw for.
        :param marginal: Draw the per-input :math:`q(u)` noise.
        :param sum_sides: Return the noise of the *sum* of the branches' outputs, under the first side's key (for
            outputs that are mapped alike, e.g. ``merge="sum"``): one normal per input and output scaled by the
            square root of the summed variance :math:`(a^e + a^r) S (a^e + a^r)^\top` (shared :math:`q(u)`) or
            :math:`a^e S^e a^e{}^\top + a^r S^r a^r{}^\top` (independent), plus the residuals.
        :return: ``{side: noise}``, each ``(B, H, d_out, N)``, for the branches that have any.

        .. note:: Cost per sequence: O(N s^2) for the products of the quadratic forms (independent of ``d_out``),
            O(N s^2 d_out) multiply-adds in one GEMM per form, O(N d_out) for the draws; O(N) for the residual.
        """
        sides = tuple(sides)
        residual = self.strategy.residual == "diag"
        marginal = marginal and not self._point_mass()  # a delta q(u) has no spread: its per-input draws are its mean
        if not marginal and not residual:
            return {}
        if sum_sides and len(sides) > 1:
            variance = self._summed_variance(scores, sides, marginal)
            return {sides[0]: self._scaled_normal(variance)}
        noises = {}
        if marginal:
            moments = self.token_noise_moments(scores, sides)
            if self._shares_posterior(sides):  # Cholesky of [[v_a, v_ab], [v_ab, v_b]] per input and output
                first, second = sides
                root = self._floored_sqrt(moments[first, first])
                loading = moments[first, second] / root
                remainder = self._floored_sqrt(moments[second, second] - loading.square())
                xi_first, xi_second = self._standard_normal(root), self._standard_normal(root)
                noises = {first: root * xi_first, second: loading * xi_first + remainder * xi_second}
            else:
                noises = {side: self._scaled_normal(moments[side, side]) for side in sides}
        if residual:
            for side in sides:
                extra = self._scaled_normal(self._residual_variance(scores, side))
                noises[side] = extra if side not in noises else noises[side] + extra
        return noises

    def summed_noise_output(self, scores: KernelEigenScores, sides: tuple[str, ...], maps: Tensor) -> Tensor | None:
        r"""The per-input noise of the *sum* of the branches' outputs (:meth:`token_noise` with ``marginal=True`` and
        ``sum_sides=True``, plus the residuals with ``residual="diag"``) mapped by the one output map ``maps``
        (``(H, d_out, C)``) shared by the summed branches, as one autograd function
        (:class:`~gpattn.variational.marginal_noise.MarginalNoiseOutput`): ``(B, N, C)``, the same draw as
        :meth:`token_noise` makes. ``None`` where that function does not apply (a :math:`q(u)` other than a Cholesky
        one, or fewer than both branches), and the caller takes :meth:`token_noise`.

        .. note:: Cost per sequence and head: O(N s^2 (s + d_out)) for the variances and O(N d_out C) for the map,
            forward and backward.
        """
        strategy = self.strategy
        distribution = strategy._variational_distribution
        sides = tuple(sides)
        both_branches = len(sides) > 1 and sides == strategy._branch_sides
        if type(distribution) is not CholeskyVariationalDistribution or not both_branches:
            return None
        interps = [self._token_interp(scores, side) for side in sides]  # (B, H, N, s) each
        if self._shares_posterior(sides):  # one u: (a_e + a_r) S (a_e + a_r)^T
            interps = (interps[0] + interps[1]).unsqueeze(0)
        else:
            interps = torch.stack(interps)
        extra = None
        if strategy.residual == "diag":
            extra = sum(self._residual_variance(scores, side) for side in sides)
        factor = distribution.chol_variational_covar  # (H, d_out, Q, s, s)
        selections = _triangle_selections(factor.shape[-1], interps.dtype, interps.device)
        autocast = autocast_state(interps.device.type)  # the draw in the dtype of the variances under autocast
        # (autocast casts float32 only: a float64 layer keeps float64 variances and draws)
        dtype = interps.dtype if autocast is None or interps.dtype == torch.float64 else autocast[1]
        batch, heads, length = interps.shape[1:4]
        noise = _normal_draws((batch, heads, factor.shape[1], length), dtype, interps.device)
        return _marginal_noise_output(interps, factor, extra, noise, maps, *selections)

    def token_noise_moments(self, scores: KernelEigenScores, sides: tuple[str, ...]) -> dict[tuple[str, str], Tensor]:
        r"""The per-input covariances of the :math:`q(u)` part of the outputs, without any :math:`N \times N` or
        ``(N, d_out, s)`` tensor: for branches :math:`a, b` with interpolation terms :math:`A^a` (``(B, H, N, s)``)
        and output :math:`c`,

        .. math::

            \operatorname{Cov}(f^a_c(x_n), f^b_c(x_n)) = A^a_n S_c A^b_n{}^\top
            = \sum_{i \leq j} w_{ij}\, \tfrac12 (A^a_{ni} A^b_{nj} + A^a_{nj} A^b_{ni})\, S_{c,ij},
            \qquad w_{ij} = 2 - \delta_{ij},

        the symmetric (Kronecker) form: the ``s(s+1)/2`` products of the upper triangle per input, then one GEMM
        against the packed :math:`S_c` of every output. Diagonal entries ``(a, a)`` for every side; the cross entry
        ``(left, right)`` when the two branches share :math:`q(u)` (independent branches are uncorrelated).

        :return: ``{(a, b): covariance}``, each ``(B, H, d_out, N)``.

        .. note:: Cost O(N s^2) per sequence for the products and O(N s^2 d_out) for each GEMM.
        """
        sides = tuple(sides)
        forms = self._quadratic_forms()
        interps = {side: self._token_interp(scores, side) for side in sides}
        moments = {(side, side): forms(interp, None, side) for side, interp in interps.items()}
        if self._shares_posterior(sides):
            moments[sides[0], sides[1]] = forms(interps[sides[0]], interps[sides[1]], sides[0])
        return moments

    @staticmethod
    def _floored_sqrt(variance: Tensor) -> Tensor:
        # floored at eps: d sqrt(v) / dv stays finite where the variance is ~ 0
        return variance.clamp_min(_variance_floor(variance.dtype)).sqrt()

    @staticmethod
    def _standard_normal(like: Tensor) -> Tensor:
        # in the logical order of the shape (randn_like would follow a permuted tensor's memory order)
        return _normal_draws(like.shape, like.dtype, like.device)

    def _scaled_normal(self, variance: Tensor) -> Tensor:
        root = self._floored_sqrt(variance)
        return root * self._standard_normal(root)

    def _residual_variance(self, scores: KernelEigenScores, side: str) -> Tensor:
        # the residual diagonal of a branch broadcast to (B, H, d_out, N)
        strategy = self.strategy
        interp, residual = strategy._interpolation(scores, side)  # (*lead, *branch_batch, N, s), (..., N)
        outputs = strategy._select_branch(strategy.variational_distribution.mean, side, 1).shape[:-1]
        return residual.expand(*torch.broadcast_shapes(interp.shape[:-2], outputs), interp.shape[-2])

    def _summed_variance(self, scores: KernelEigenScores, sides: tuple[str, ...], marginal: bool) -> Tensor:
        # the per-input variance of the sum of the branches' token noises, (B, H, d_out, N)
        variance = 0.0
        if marginal:  # (token_noise, its one caller, has set it false for a delta q(u))
            forms = self._quadratic_forms()
            interps = [self._token_interp(scores, side) for side in sides]
            if self._shares_posterior(sides):  # one u: (a_e + a_r) S (a_e + a_r)^T
                variance = forms(interps[0] + interps[1], None, sides[0])
            else:
                for side, interp in zip(sides, interps, strict=True):
                    variance = variance + forms(interp, None, side)
        if self.strategy.residual == "diag":
            for side in sides:
                variance = variance + self._residual_variance(scores, side)
        return variance

    def _shares_posterior(self, sides: tuple[str, ...]) -> bool:
        # two branches drawn from one q(u) (a pair with a branch dimension of size 1)
        strategy = self.strategy
        return (
            len(sides) > 1
            and len(strategy._branch_sides) > 1
            and strategy._variational_distribution.batch_shape[-1] == 1
        )

    def _token_interp(self, scores: KernelEigenScores, side: str) -> Tensor:
        check_choice("side", side, self.strategy._branch_sides, where=type(self).__name__)
        return scores.interp(side, self.strategy.whiten)  # (B, H, N, s): no output dimensions

    def _quadratic_forms(self):
        r"""A function ``(a, b, side) -> a_n S_c b_n^T`` for every input ``n`` and output ``c`` of the branch
        ``side`` (``b = a`` when ``None``), ``(B, H, d_out, N)`` from ``(B, H, N, s)`` terms, in the symmetric
        (Kronecker) form :math:`\sum_{i \leq j} w_{ij} \tfrac12 (a_i b_j + a_j b_i) S_{ij}`, :math:`w_{ij} = 2 -
        \delta_{ij}`: ``s(s+1)/2`` products per input, then one GEMM against the packed :math:`S_c` of every
        output."""
        strategy = self.strategy
        variational = strategy._variational_distribution
        if type(variational) is CholeskyVariationalDistribution:  # S = L L^T from the parameter: no GPyTorch objects
            lower = variational.chol_variational_covar.tril()
            covariance = lower @ lower.mT  # (*q_batch, s, s), tiny
        elif self._point_mass():  # a delta q(u): S = 0
            mean = variational.variational_mean
            covariance = mean.new_zeros(*mean.shape, mean.shape[-1])
        else:
            covariance = strategy.variational_distribution.lazy_covariance_matrix.to_dense()
        size, dims = covariance.shape[-1], strategy.num_output_dims
        rows, cols, weights, first_selection, second_selection = _triangle_selections(
            size, covariance.dtype, covariance.device
        )
        packed = covariance[..., rows, cols] * weights  # the upper triangle, off-diagonal entries doubled: (*, P)
        end = len(variational.batch_shape) - int(len(strategy._branch_sides) > 1)
        outputs = variational.batch_shape[end - dims : end]

        def forms(first: Tensor, second: Tensor | None, side: str) -> Tensor:
            if second is None:
                products = (first @ first_selection) * (first @ second_selection)
            else:
                products = 0.5 * (
                    (first @ first_selection) * (second @ second_selection)
                    + (first @ second_selection) * (second @ first_selection)
                )
            branch = strategy._select_branch(packed, side, 1)  # (*lead_q, *outputs, P)
            flat = branch.reshape(*branch.shape[: branch.dim() - 1 - dims], -1, branch.shape[-1])
            result = products @ flat.mT  # (*batch, N, P) x (*lead_q, P, D) -> (*batch, N, D)
            if not dims:
                return result.squeeze(-1)
            return result.unflatten(-1, outputs).movedim(-1 - dims, -1)

        return forms


def _triangle_selections(size: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, ...]:
    r"""The constants of the symmetric form of :meth:`KernelEigenReadout._quadratic_forms` for the ``P = s(s+1)/2``
    entries :math:`(i, j)`, :math:`i \leq j`, of the upper triangle (row-major, as :func:`torch.triu_indices`): their
    rows and columns (indices on ``device``), the weights :math:`w_{ij} = 2 - \delta_{ij}`, and the one-hot ``(s, P)``
    matrices whose products pick :math:`a_i` and :math:`a_j` (GEMMs: gathers are several times slower on CPU, forward
    and backward). Built once per size, dtype and device and never written to; built afresh while compiling."""
    if is_compiling():
        return _build_triangle_selections(size, dtype, device)
    return _cached_triangle_selections(size, dtype, device)


@functools.cache  # never evicted: a CUDA graph that captured a step keeps reading these tensors
def _cached_triangle_selections(size: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, ...]:
    with torch.inference_mode(False):  # normal tensors, usable with autograd, even when first built for inference
        return _build_triangle_selections(size, dtype, device)


def _build_triangle_selections(size: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, ...]:
    rows, cols = torch.triu_indices(size, size, device=device)
    columns = torch.arange(rows.numel(), device=device)
    first_selection = torch.zeros(size, rows.numel(), dtype=dtype, device=device)
    second_selection = torch.zeros(size, rows.numel(), dtype=dtype, device=device)
    first_selection[rows, columns] = 1.0
    second_selection[cols, columns] = 1.0
    return rows, cols, 2.0 - (rows == cols).to(dtype), first_selection, second_selection
