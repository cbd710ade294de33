"""Per-input noise of the kernel-eigen strategies' outputs: the "marginal" sampling of the papers' official code and
the diagonal residual, drawn from the per-input variances :math:`a S a^\top` (and the residual) computed in one
matrix multiply per branch, without ``(B, H, N, d_out, s)`` intermediates. A mixin of
:class:`~gpattn.variational.KernelEigenVariationalStrategy` (it reads the strategy's ``interpolation``,
``branch_posterior``, ``branch_sides`` and ``num_output_dims``)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..features import KernelEigenScores
from ..validation import check_choice


class TokenNoise:
    """The per-input noise of a kernel-eigen strategy (see the module docstring)."""

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
        :return: ``{side: noise}``, each ``(*batch, *outputs, N)``, for the branches that have any.

        .. note:: Cost per sequence: O(N s^2) for the products of the quadratic forms (independent of ``d_out``),
            O(N s^2 d_out) multiply-adds in one GEMM per form, O(N d_out) for the draws; O(N) for the residual.
        """
        sides = tuple(sides)
        if not marginal and self.residual != "diag":
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
        if self.residual == "diag":
            for side in sides:
                extra = self._scaled_normal(self._residual_variance(scores, side))
                noises[side] = extra if side not in noises else noises[side] + extra
        return noises

    @staticmethod
    def _floored_sqrt(variance: Tensor) -> Tensor:
        # floored at eps: d sqrt(v) / dv stays finite where the variance is ~ 0
        return variance.clamp_min(torch.finfo(variance.dtype).eps).sqrt()

    @staticmethod
    def _standard_normal(like: Tensor) -> Tensor:
        # in the logical order of the shape (randn_like would follow a permuted tensor's memory order)
        return torch.randn(like.shape, dtype=like.dtype, device=like.device)

    def _scaled_normal(self, variance: Tensor) -> Tensor:
        root = self._floored_sqrt(variance)
        return root * self._standard_normal(root)

    def _residual_variance(self, scores: KernelEigenScores, side: str) -> Tensor:
        """The residual diagonal of a branch broadcast to ``(*batch, *outputs, N)``."""
        interp, residual = self.interpolation(scores, side)  # (*lead, *branch_batch, N, s), (..., N)
        outputs = self.select_branch(self.variational_distribution.mean, side, 1).shape[:-1]  # the branch's batch
        return residual.expand(*torch.broadcast_shapes(interp.shape[:-2], outputs), interp.shape[-2])

    def _summed_variance(self, scores: KernelEigenScores, sides: tuple[str, ...], marginal: bool) -> Tensor:
        """The per-input variance of the sum of the branches' token noises, ``(*batch, *outputs, N)``."""
        variance = 0.0
        if marginal:
            forms = self._quadratic_forms()
            interps = [self._token_interp(scores, side) for side in sides]
            if self._shares_posterior(sides):  # one u: (a_e + a_r) S (a_e + a_r)^T
                variance = forms(interps[0] + interps[1], None, sides[0])
            else:
                for side, interp in zip(sides, interps, strict=True):
                    variance = variance + forms(interp, None, side)
        if self.residual == "diag":
            for side in sides:
                variance = variance + self._residual_variance(scores, side)
        return variance

    def _shares_posterior(self, sides: tuple[str, ...]) -> bool:
        # two branches drawn from one q(u) (a pair with a branch dimension of size 1)
        return len(sides) > 1 and len(self.branch_sides) > 1 and self._variational_distribution.batch_shape[-1] == 1

    def _token_interp(self, scores: KernelEigenScores, side: str) -> Tensor:
        check_choice("side", side, self.branch_sides, where=type(self).__name__)
        return scores.interp(side, self.whiten)  # (*batch, N, s): no output dimensions

    def _quadratic_forms(self):
        r"""A function ``(a, b, side) -> a_n S_c b_n^T`` for every input ``n`` and output ``c`` of the branch
        ``side`` (``b = a`` when ``None``), ``(*batch, *outputs, N)`` from ``(*batch, N, s)`` terms, in the symmetric
        (Kronecker) form :math:`\sum_{i \leq j} w_{ij} \tfrac12 (a_i b_j + a_j b_i) S_{ij}`, :math:`w_{ij} = 2 -
        \delta_{ij}`: ``s(s+1)/2`` products per input, then one GEMM against the packed :math:`S_c` of every
        output."""
        variational = self._variational_distribution
        covariance = self.variational_distribution.lazy_covariance_matrix.to_dense()  # (*q_batch, s, s), tiny
        size, dims = covariance.shape[-1], self.num_output_dims
        rows, cols = torch.triu_indices(size, size, device=covariance.device)
        packed = covariance[..., rows, cols] * (2.0 - (rows == cols).to(covariance.dtype))
        end = len(variational.batch_shape) - int(len(self.branch_sides) > 1)
        outputs = variational.batch_shape[end - dims : end]
        # the entries a_i and a_j of the upper triangle by GEMMs with one-hot columns (gathers are several times
        # slower on CPU, forward and backward)
        columns = torch.arange(rows.numel(), device=covariance.device)
        first_selection = covariance.new_zeros(size, rows.numel())
        second_selection = covariance.new_zeros(size, rows.numel())
        first_selection[rows, columns] = 1.0
        second_selection[cols, columns] = 1.0

        def forms(first: Tensor, second: Tensor | None, side: str) -> Tensor:
            if second is None:
                products = (first @ first_selection) * (first @ second_selection)
            else:
                products = 0.5 * (
                    (first @ first_selection) * (second @ second_selection)
                    + (first @ second_selection) * (second @ first_selection)
                )
            branch = self.select_branch(packed, side, 1)  # (*lead_q, *outputs, P)
            flat = branch.reshape(*branch.shape[: branch.dim() - 1 - dims], -1, branch.shape[-1])
            result = products @ flat.mT  # (*batch, N, P) x (*lead_q, P, D) -> (*batch, N, D)
            if not dims:
                return result.squeeze(-1)
            return result.unflatten(-1, outputs).movedim(-1 - dims, -1)

        return forms

    def token_noise_moments(self, scores: KernelEigenScores, sides: tuple[str, ...]) -> dict[tuple[str, str], Tensor]:
        r"""The per-input covariances of the :math:`q(u)` part of the outputs, without any :math:`N \times N` or
        ``(N, d_out, s)`` tensor: for branches :math:`a, b` with interpolation terms :math:`A^a` (``(*batch, N,
        s)``) and output :math:`c`,

        .. math::

            \operatorname{Cov}(f^a_c(x_n), f^b_c(x_n)) = A^a_n S_c A^b_n{}^\top
            = \sum_{i \leq j} w_{ij}\, \tfrac12 (A^a_{ni} A^b_{nj} + A^a_{nj} A^b_{ni})\, S_{c,ij},
            \qquad w_{ij} = 2 - \delta_{ij},

        the symmetric (Kronecker) form: the ``s(s+1)/2`` products of the upper triangle per input, then one GEMM
        against the packed :math:`S_c` of every output. Diagonal entries ``(a, a)`` for every side; the cross entry
        ``(left, right)`` when the two branches share :math:`q(u)` (independent branches are uncorrelated).

        :return: ``{(a, b): covariance}``, each ``(*batch, *outputs, N)``.

        .. note:: Cost O(N s^2) per sequence for the products and O(N s^2 d_out) for each GEMM.
        """
        sides = tuple(sides)
        forms = self._quadratic_forms()
        interps = {side: self._token_interp(scores, side) for side in sides}
        moments = {(side, side): forms(interp, None, side) for side, interp in interps.items()}
        if self._shares_posterior(sides):
            moments[sides[0], sides[1]] = forms(interps[sides[0]], interps[sides[1]], sides[0])
        return moments
