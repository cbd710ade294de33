"""KEP-SVGP attention: a pair of kernel-eigen SVGPs per head (Chen, Tao, Tonin & Suykens, ICML 2024)."""

from __future__ import annotations

import torch
from gpytorch.variational import CholeskyVariationalDistribution
from torch import Tensor

from ..features import AttentionKernelEigenFeatures, KernelEigenScores
from ..features.amortized_scores import StackedKernelEigenScores
from ..validation import check_choice, check_int
from ..variational import KernelEigenPairVariationalStrategy, KernelEigenVariationalStrategy
from ._base import AttentionLayer

MERGES = ("sum", "concat", "concat_tokens")
SAMPLINGS = ("joint", "marginal")
RESIDUALS = ("none", "diag")


class KEPSVGPAttention(AttentionLayer):
    r"""Multi-head KEP-SVGP attention: two sparse variational GPs per head whose inducing variables are the
    projections on the KSVD's left and right singular vectors (docs/math.md section 3).

    The layer is per-sequence kernel-eigen features plus the GPyTorch pair strategy plus output maps:

    * :attr:`features` (:class:`~gpattn.features.AttentionKernelEigenFeatures`) give, for each sequence and head, the
      scores :math:`e(x)` at the queries, :math:`r(z)` at the keys and the singular values :math:`\Lambda` (a
      :class:`~gpattn.features.KernelEigenScores`), and hold the KSVD penalty;
    * :attr:`strategy` (:class:`~gpattn.variational.KernelEigenPairVariationalStrategy`; the single-branch
      :class:`~gpattn.variational.KernelEigenVariationalStrategy` with ``tie_qk=True``) holds :math:`q(u)`, a GPyTorch
      ``CholeskyVariationalDistribution`` with batch ``(H, d_out, 2)`` (heads, the ``d_out`` GP outputs of a head,
      branches), against the prior :math:`\mathcal N(0, \Lambda^2)`; the forward pass, the KL and :meth:`posterior`
      all come from the strategy's :math:`q(f)`;
    * per-head output maps :math:`d_{out} \to` head width and ``out_proj`` map the GP outputs to the layer output.

    The ``d_out`` GP outputs of a head share the kernel and have independent :math:`q(u_c) = \mathcal N(m_c, S_c)`,
    so

    .. math::

        F_e = e(X) \Lambda^{-1} u_e, \qquad F_r = r(X) \Lambda^{-1} u_r, \qquad
        \mathrm{KL} = \sum_{h, c, \text{branch}} \mathrm{KL}(q(u) \,\|\, \mathcal N(0, \Lambda^2)),

    with :math:`K_{uu} = \Lambda^2` inverted in O(s). Merging: ``"sum"`` :math:`F = F_e + F_r` (with
    ``shared_posterior=True`` the official code's :math:`(e + r)\Lambda^{-1} u` with one KL); ``"concat"``
    :math:`[F_e, F_r]` then a per-head linear map :math:`2 d_{out} \to` head width; ``"concat_tokens"`` the
    paper's token-axis :math:`W_{tok} [F_e; F_r]` (:math:`2N \to N`, needs ``max_len``). Each head then maps
    :math:`d_{out} \to` head width, heads are concatenated and projected.

    Sampling (training, or eval inside :func:`~gpattn.attention.sample_attention`): ``"joint"`` draws
    :math:`u = m + L \varepsilon` once per sequence, output dimension and branch and sets :math:`F = e \Lambda^{-1} u`:
    the exact joint distribution of the low-rank part across tokens at the cost of the mean, O(N s d_out).
    ``"marginal"`` (the official code's) draws independent noise per token with the right marginals only,
    O(N s^2 d_out). ``residual="diag"`` adds the residual variance :math:`k(x, x) - \|e(x)\|^2` per token. Eval
    mode returns the predictive mean. The KSVD penalty :math:`J^2` (mean over sequences, sum over heads) is the
    added loss term ``"ksvd_loss"``, weighted by :math:`\eta` = ``ksvd_weight`` (as every GPyTorch added loss term, it
    carries its own weight: :class:`~gpattn.mlls.AttentionELBO` and GPyTorch's MLLs add it as it is).

    With ``context`` (cross-attention) the output at the queries is the left branch alone: :math:`r` lives on the
    keys. With ``tie_qk=True`` (the symmetric KEP ablation) :math:`H_e = H_r` and one branch is used.

    :param embed_dim: Token width :math:`C`.
    :param num_heads: :math:`H`.
    :param num_inducing: :math:`s`, the KSVD rank (default :math:`\min(10, p)`, :math:`p` the feature dimension).
    :param features: ``"amortized"`` (gpattn's default), ``"primal_tokens"`` (the official parametrisation
        :math:`W_{e|X} = \tilde X_h^\top \tilde W_e`, see :class:`~gpattn.features.AttentionKernelEigenFeatures`),
        ``"primal_features"`` (a gpattn variant) or ``"exact"``.
    :param merge: ``"sum"``, ``"concat"`` or ``"concat_tokens"``.
    :param shared_posterior: One :math:`q(u)` for both branches.
    :param sampling: ``"joint"`` or ``"marginal"``.
    :param residual: ``"none"`` or ``"diag"``.
    :param kernel: ``"cosine"`` or ``"exponential"`` (exact features only).
    :param tie_qk: Symmetric kernel :math:`W_q = W_k`.
    :param max_len: Sequence length for ``features="primal_tokens"`` and ``merge="concat_tokens"``.
    :param dropout: Output dropout.
    :param num_outputs: GP outputs per head ``d_out`` (default: the head width; ``"num_inducing"``: :math:`d_{out} = s`,
        as in the official code, whose ``m_u`` is ``s x s``).
    :param feature_dim: Kernel feature dimension :math:`p` (default: the head width); the cosine kernel has rank
        :math:`\le p`, so ``num_inducing <= feature_dim``.
    :param ksvd_weight: :math:`\eta \geq 0`, the weight of the KSVD penalty :math:`\eta J^2`.
    :param ksvd_form: ``"sum"`` (the token-sum :math:`J` per sequence and head) or ``"official"`` (the official
        code's mean-over-tokens :math:`J_{\mathrm{off}}` with the trace of the raw weights; ``"primal_tokens"`` only);
        see :func:`~gpattn.ksvd.ksvd_objective`.

    The paper's configuration (registry row ``"kep_svgp_paper"``) is ``features="primal_tokens"``,
    ``shared_posterior=True``, ``sampling="marginal"``, ``num_outputs="num_inducing"``, ``ksvd_form="official"``;
    the official code's KL and its ``1/n``-less weight are *not* reproduced (docs/guide/papers.md).

    .. note:: Cost per head (amortised features, joint sampling): O(N C s + N p s) for the scores, O(N s d_out)
        for the output, O(s) for the prior terms of the KL, O(s^2 d_out) for its variational terms; no
        :math:`N \times N` matrix. Marginal sampling adds O(N s^2 d_out); exact features O(N M p + N M min(N, M)).
    """

    is_stochastic = True

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        num_inducing: int | None = None,
        features: str = "amortized",
        merge: str = "sum",
        shared_posterior: bool = False,
        sampling: str = "joint",
        residual: str = "none",
        kernel: str = "cosine",
        tie_qk: bool = False,
        max_len: int | None = None,
        dropout: float = 0.0,
        num_outputs: int | str | None = None,
        feature_dim: int | None = None,
        ksvd_weight: float = 1.0,
        ksvd_form: str = "sum",
    ):
        super().__init__(embed_dim, num_heads, dropout)
        where = type(self).__name__
        check_choice("merge", merge, MERGES, where=where)
        check_choice("sampling", sampling, SAMPLINGS, where=where)
        check_choice("residual", residual, RESIDUALS, where=where)
        if tie_qk and (merge != "sum" or shared_posterior):
            raise ValueError(f"{where}: tie_qk=True uses one branch: merge must be 'sum' and shared_posterior False")
        if merge == "concat_tokens":
            if max_len is None:
                raise ValueError(f"{where}: merge='concat_tokens' needs max_len (its fixed sequence length)")
            check_int("max_len (the sequence length of merge='concat_tokens')", max_len, where=where)
        kernel_features = AttentionKernelEigenFeatures(
            embed_dim,
            num_heads,
            num_inducing,
            mode=features,
            kernel=kernel,
            feature_dim=feature_dim,
            tie_qk=tie_qk,
            max_len=max_len,
            ksvd_weight=ksvd_weight,
            ksvd_form=ksvd_form,
        )
        if features in ("primal_tokens", "primal_features"):  # the weights read every token of the sequence
            self.supports_causal = self.supports_cross_attention = False
        self.num_inducing = num_inducing = kernel_features.num_inducing  # the default resolved there: min(10, p)
        if num_outputs is None:
            num_outputs = self.head_dim
        elif num_outputs == "num_inducing":  # the official code's d_out = s
            num_outputs = num_inducing
        self.num_outputs = check_int("num_outputs", num_outputs, where=where)
        self.merge, self.sampling_mode, self.residual = merge, sampling, residual
        self.shared_posterior, self.tie_qk, self.max_len = bool(shared_posterior), bool(tie_qk), max_len
        outputs = torch.Size([num_heads, self.num_outputs])
        options = dict(features=kernel_features, residual=residual, num_output_dims=1)
        if self.tie_qk:  # H_e = H_r: one branch
            posterior = CholeskyVariationalDistribution(num_inducing, batch_shape=outputs)
            self.strategy = KernelEigenVariationalStrategy(self, None, posterior, side="left", **options)
        else:
            branches = torch.Size([1 if self.shared_posterior else 2])
            posterior = CholeskyVariationalDistribution(num_inducing, batch_shape=outputs + branches)
            self.strategy = KernelEigenPairVariationalStrategy(
                self, None, posterior, shared_posterior=self.shared_posterior, **options
            )
        # m ~ N(0, Lambda^2) so that Lambda^{-1} m acts like a random value projection, S = (0.1 Lambda)^2; exact
        # features have a Lambda per sequence only, so their q(u) starts at unit scale
        scale = torch.ones(num_heads, num_inducing) if features == "exact" else kernel_features.singular_values
        self.strategy.initialize_at_prior_draw(scale.detach(), covariance_scale=0.1)
        width = 2 * self.num_outputs if merge == "concat" else self.num_outputs
        bound = width**-0.5
        # per-head output map d_out (or 2 d_out) -> head width; shape (H, width, head_dim)
        self.output_weight = torch.nn.Parameter(torch.empty(num_heads, width, self.head_dim).uniform_(-bound, bound))
        if merge == "concat_tokens":
            # token-axis merge [F_e; F_r] (2N) -> N per head, initialised at (F_e + F_r) / 2
            eye = torch.eye(max_len)
            self.token_weight = torch.nn.Parameter(
                0.5 * torch.cat([eye, eye], dim=-1).expand(num_heads, -1, -1).clone()
            )

    @property
    def features(self) -> AttentionKernelEigenFeatures:
        """The per-sequence kernel-eigen features (owned by :attr:`strategy`)."""
        return self.strategy.features

    def learned_spectrum(self) -> Tensor | None:
        r"""The learned KSVD singular values per head, shape ``(H, s)``, or ``None`` with exact features (whose
        :math:`\Lambda` belongs to each sequence)."""
        return None if self.features.mode == "exact" else self.features.singular_values.detach()

    # -- the pieces ----------------------------------------------------------------------------------------------------
    def _sides(self, is_cross: bool) -> tuple[str, ...]:
        # the branches evaluated at the queries: r lives on the keys in cross-attention; one branch when tied
        return ("left",) if (self.tie_qk or is_cross) else ("left", "right")

    def _output_maps(self, branches: int) -> list[Tensor]:
        r"""The linear maps from a branch's GP outputs to the layer output, each ``(H, d_out, C)``:
        :math:`C^b_h = W^b_h P_h^\top` with the branch's rows :math:`W^b_h` of the per-head output map and the head
        block :math:`P_h` of ``out_proj`` (so ``y = b + sum_{b, h} F^b_h C^b_h``)."""
        projection = self.head_projection()  # (H, hd, C)
        width = self.num_outputs
        maps = []
        for index in range(branches):
            rows = slice(index * width, (index + 1) * width) if self.merge == "concat" else slice(0, width)
            maps.append(self.output_weight[:, rows] @ projection)
        return maps

    def _mix_tokens(self, tensor: Tensor, index: int) -> Tensor:
        """``merge="concat_tokens"``: branch ``index``'s block of :math:`W_{tok} [F_e; F_r]` applied to a
        ``(B, H, N, k)`` tensor; the identity for the other merges."""
        if self.merge != "concat_tokens":
            return tensor
        if tensor.shape[-2] != self.max_len:
            raise ValueError(f"merge='concat_tokens' needs sequences of length {self.max_len}, got {tensor.shape[-2]}")
        return self.token_weight[..., index * self.max_len : (index + 1) * self.max_len] @ tensor

    def _output(self, scores: KernelEigenScores, is_cross: bool, sample: bool) -> Tensor:
        r"""The layer output before dropout, ``(B, N, C)``: the predictive mean, or a sample.

        The output is linear in the GP outputs, :math:`y = b + \sum_{b, h} F^b_h C^b_h` (:meth:`_output_maps`), and
        :math:`F^b_h = e^b_h \Lambda_h^{-1} u^b_h{}^\top` with :math:`u = m` (mean) or a joint draw :math:`u = m + L
        \varepsilon` per sequence (:meth:`~gpattn.variational.KernelEigenVariationalStrategy.inducing_draw`; branches
        with a shared posterior share it). So the strategy's small ``(H, s, C)`` coefficients :math:`\Lambda^{-1} u^\top
        C` (:meth:`~gpattn.variational.KernelEigenVariationalStrategy.linear_coefficients`) are formed first and each
        branch costs one GEMM of inner dimension :math:`H s`: no ``(B, H, N, d_out)`` tensor. When the features
        computed both branches' scores as one tensor (the fused amortised path,
        :class:`~gpattn.features.amortized_scores.StackedKernelEigenScores`), both branches are one GEMM of inner
        dimension :math:`2 H s` with the stacked coefficients (one pass over the ``(B, N, C)`` output, not two).
        ``"marginal"`` sampling and the residual add per-token noise of the GP outputs
        (:meth:`~gpattn.variational.KernelEigenVariationalStrategy.token_noise`), mapped by :math:`C` too.
        """
        sides = self._sides(is_cross)
        maps = self._output_maps(len(sides))
        joint = sample and self.sampling_mode == "joint"
        draw = self.strategy.inducing_draw(torch.Size([scores.left_scores.shape[0]]) if joint else None)
        noises = {}
        if sample and (self.sampling_mode == "marginal" or self.residual == "diag"):
            marginal = self.sampling_mode == "marginal"  # merge="sum": one draw for the sum of the branches
            noises = self.strategy.token_noise(scores, sides, marginal, sum_sides=marginal and self.merge == "sum")
        output = self.out_proj.bias
        coefficients = [
            self.strategy.linear_coefficients(side, draw, output_map, scores.singular_values, active=scores.active)
            for side, output_map in zip(sides, maps, strict=True)
        ]
        stacked = scores.stacked if isinstance(scores, StackedKernelEigenScores) else None
        one_gemm = stacked is not None and sides == ("left", "right") and self.merge != "concat_tokens"
        if one_gemm:
            # both branches in one GEMM of inner dimension 2 H s: the scores [e^T; r^T] are one (B, 2, H, s, N)
            # tensor, so their (B, N, 2 H s) view needs no copy; the coefficients stack alike: (..., 2 H, s, C)
            paired = torch.stack(coefficients, dim=-4).flatten(-4, -3)
            output = self.accumulate_heads(output, stacked.flatten(1, 2).mT, paired)
        for index, (side, output_map) in enumerate(zip(sides, maps, strict=True)):
            if not one_gemm:
                output = self.accumulate_heads(
                    output, self._mix_tokens(scores.scores(side), index), coefficients[index]
                )
            if side in noises:  # per-token noise of the GP outputs: (B, H, d_out, N)
                noise = self._mix_tokens(noises[side].mT, index)  # (B, H, N, d_out)
                output = output + torch.einsum("bhnd,hdc->bnc", noise, output_map)
        return output

    def _features(self, x: Tensor, mask: Tensor | str | None, context: Tensor | None) -> tuple[KernelEigenScores, bool]:
        inputs = self._prepare(x, mask, context)
        if self.merge == "concat_tokens" and (inputs.key_mask is not None or inputs.causal or inputs.is_cross):
            raise ValueError("merge='concat_tokens' supports plain self-attention only (no mask, no context)")
        scores = self.features(
            inputs.queries,
            inputs.keys,
            inputs.key_mask,
            inputs.causal,
            objective=self.training,
            kernel_diag=self.residual == "diag",
        )
        return scores, inputs.is_cross

    def forward(self, x: Tensor, mask: Tensor | str | None = None, context: Tensor | None = None) -> Tensor:
        scores, is_cross = self._features(x, mask, context)
        return self.dropout(self._output(scores, is_cross, sample=self.sampling))

    # -- probabilistic interface -----------------------------------------------------------------------------------
    def kl_divergence(self) -> Tensor:
        r""":math:`\sum_{h, c, \text{branch}} \mathrm{KL}(q(u) \| \mathcal N(0, \Lambda^2))`, a scalar: the strategy's
        KL summed over heads and outputs; with exact features :math:`\Lambda` is the last call's and the KL is averaged
        over its sequences."""
        kl = self.strategy.kl_divergence().sum(dim=(-2, -1))  # (B,) with exact features, () otherwise
        return kl.mean() if kl.dim() else kl

    def posterior(
        self, x: Tensor, mask: Tensor | str | None = None, context: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        r"""Predictive mean and variance of the layer's output, each ``(B, N, C)`` (dropout off): the strategy's
        :math:`q(f)` at the tokens (:meth:`~gpattn.variational.KernelEigenVariationalStrategy.predictive_parts`)
        pushed through the output maps.

        The output is linear in the GP outputs, which are independent across heads and output dimensions, so
        :math:`\operatorname{Var}(y_{nj}) = \sum_{h, c} \big\| \sum_{b} C^b_{hcj}\, e^b_n \Lambda^{-1} L_c \big\|^2
        + \sum_{b, h, c} (C^b_{hcj})^2 \rho^b_n` with the combined weights :math:`C` of the output maps and the
        residual :math:`\rho` (cross-branch terms only with a shared posterior).
        """
        if self.merge == "concat_tokens":
            raise NotImplementedError("posterior() is not available for merge='concat_tokens' (token mixing)")
        previous = self.training
        self.train(False)
        try:
            scores, is_cross = self._features(x, mask, context)
            mean = self._output(scores, is_cross, sample=False)
            variance = self._output_variance(scores, is_cross)
        finally:
            self.train(previous)
        return mean, variance

    def _output_variance(self, scores: KernelEigenScores, is_cross: bool) -> Tensor:
        sides = self._sides(is_cross)
        weights = self._output_maps(len(sides))  # C^b_{h,c,j}: (H, d_out, C) per branch
        parts = [self.strategy.predictive_parts(scores, side) for side in sides]  # root (B, H, d_out, N, s)
        variance = 0.0
        for a, (_, root_a, _) in enumerate(parts):
            for b, (_, root_b, _) in enumerate(parts):
                if a == b or self.shared_posterior:
                    inner = (root_a * root_b).sum(-1)  # (B, H, d_out, N)
                    variance = variance + torch.einsum("bhcn,hcj,hcj->bnj", inner, weights[a], weights[b])
        for (_, _, residual), weight in zip(parts, weights, strict=True):
            if residual is not None:
                variance = variance + torch.einsum("bhcn,hcj->bnj", residual, weight.pow(2))
        return variance
