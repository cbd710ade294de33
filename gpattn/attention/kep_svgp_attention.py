"""KEP-SVGP attention: a pair of kernel-eigen SVGPs per head (Chen, Tao, Tonin & Suykens, ICML 2024)."""

from __future__ import annotations

import dataclasses

import torch
from gpytorch.variational import CholeskyVariationalDistribution
from torch import Tensor

from ..features.attention_kernel_eigen_features import AttentionKernelEigenFeatures, AttentionScores
from ..mlls import KSVDAddedLossTerm
from ..validation import check_float, check_int
from ..variational._structured import diagonal_prior_kl
from ._base import AttentionLayer

MERGES = ("sum", "concat", "concat_tokens")
SAMPLINGS = ("joint", "marginal")
RESIDUALS = ("none", "diag")


class KEPSVGPAttention(AttentionLayer):
    r"""Multi-head KEP-SVGP attention: two sparse variational GPs per head whose inducing variables are the
    projections on the KSVD's left and right singular vectors (MATH.md section 3).

    For each head the scores :math:`e(x)`, :math:`r(z)` and singular values :math:`\Lambda` come from
    :class:`~gpattn.features.AttentionKernelEigenFeatures`. The ``d_out`` GP outputs of a head share the kernel and
    have independent :math:`q(u_c) = \mathcal N(m_c, S_c)` (a GPyTorch batch over heads and outputs) against the
    prior :math:`\mathcal N(0, \Lambda^2)`, so

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
    :param features: ``"amortized"``, ``"primal_tokens"`` or ``"exact"``.
    :param merge: ``"sum"``, ``"concat"`` or ``"concat_tokens"``.
    :param shared_posterior: One :math:`q(u)` for both branches.
    :param sampling: ``"joint"`` or ``"marginal"``.
    :param residual: ``"none"`` or ``"diag"``.
    :param kernel: ``"cosine"`` or ``"exponential"`` (exact features only).
    :param tie_qk: Symmetric kernel :math:`W_q = W_k`.
    :param max_len: Sequence length for ``features="primal_tokens"`` and ``merge="concat_tokens"``.
    :param dropout: Output dropout.
    :param num_outputs: GP outputs per head ``d_out`` (default: the head width).
    :param feature_dim: Kernel feature dimension :math:`p` (default: the head width); the cosine kernel has rank
        :math:`\le p`, so ``num_inducing <= feature_dim``.
    :param ksvd_weight: :math:`\eta \geq 0`, the weight of the KSVD penalty :math:`\eta J^2`.

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
        num_outputs: int | None = None,
        feature_dim: int | None = None,
        ksvd_weight: float = 1.0,
    ):
        super().__init__(embed_dim, num_heads, dropout)
        self.ksvd_weight = check_float("ksvd_weight", ksvd_weight, 0.0, where=type(self).__name__)
        for name, value, allowed in (("merge", merge, MERGES), ("sampling", sampling, SAMPLINGS)):
            if value not in allowed:
                raise ValueError(f"expected {name} in {allowed}, got {value!r}")
        if residual not in RESIDUALS:
            raise ValueError(f"expected residual in {RESIDUALS}, got {residual!r}")
        if tie_qk and (merge != "sum" or shared_posterior):
            raise ValueError("tie_qk=True uses one branch: merge must be 'sum' and shared_posterior False")
        if merge == "concat_tokens" and (isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1):
            raise ValueError(f"merge='concat_tokens' needs an integer max_len, got {max_len!r}")
        if num_outputs is not None:
            check_int("num_outputs", num_outputs, where=type(self).__name__)
        self.features = AttentionKernelEigenFeatures(
            embed_dim,
            num_heads,
            num_inducing,
            mode=features,
            kernel=kernel,
            feature_dim=feature_dim,
            tie_qk=tie_qk,
            max_len=max_len,
        )
        num_inducing = self.features.num_inducing  # the default resolved there: min(10, p)
        self.num_inducing, self.merge, self.sampling_mode, self.residual = num_inducing, merge, sampling, residual
        self.shared_posterior, self.tie_qk, self.max_len = bool(shared_posterior), bool(tie_qk), max_len
        self.num_outputs = self.head_dim if num_outputs is None else num_outputs
        self.register_added_loss_term("ksvd_loss")
        self._last_singular_values: Tensor | None = None
        batch = torch.Size([num_heads, self.num_outputs])
        self.left_posterior = CholeskyVariationalDistribution(num_inducing, batch_shape=batch)
        if not (self.shared_posterior or self.tie_qk):
            self.right_posterior = CholeskyVariationalDistribution(num_inducing, batch_shape=batch)
        self._initialize_posteriors()
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

    def _initialize_posteriors(self) -> None:
        # m ~ N(0, Lambda^2) so that Lambda^{-1} m acts like a random value projection; S = (0.1 Lambda)^2
        with torch.no_grad():
            if self.features.mode == "exact":
                scale = torch.ones(self.num_heads, 1, self.num_inducing)
            else:
                scale = self.features.singular_values.unsqueeze(1)
            for posterior in self._posteriors():
                posterior.variational_mean.copy_(scale * torch.randn_like(posterior.variational_mean))
                posterior.chol_variational_covar.copy_(
                    torch.diag_embed(0.1 * scale.expand_as(posterior.variational_mean))
                )

    def _posteriors(self) -> list[CholeskyVariationalDistribution]:
        return [self.left_posterior] + ([self.right_posterior] if "right_posterior" in self._modules else [])

    def _branch_posteriors(self) -> tuple[CholeskyVariationalDistribution, CholeskyVariationalDistribution | None]:
        if self.tie_qk:
            return self.left_posterior, None
        return self.left_posterior, self.left_posterior if self.shared_posterior else self.right_posterior

    # -- the pieces ----------------------------------------------------------------------------------------------------
    def _branch_scores(self, scores: AttentionScores, is_cross: bool) -> list[tuple[Tensor, Tensor | None]]:
        """``[(scores, residual)]`` per branch used at the queries: :math:`e` (and :math:`r`), each ``(B, H, N, s)``,
        with the residual variance ``(B, H, N)`` or ``None``."""
        sides = ["left"] if (self.tie_qk or is_cross) else ["left", "right"]
        return [
            (
                scores.left if side == "left" else scores.right,
                scores.residual_diag(side) if self.residual == "diag" else None,
            )
            for side in sides
        ]

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

    def _output(self, scores: AttentionScores, is_cross: bool, sample: bool) -> Tensor:
        r"""The layer output before dropout, ``(B, N, C)``: the predictive mean, or a sample.

        The output is linear in the GP outputs, :math:`y = b + \sum_{b, h} F^b_h C^b_h` (:meth:`_output_maps`), and
        :math:`F^b_h = e^b_h \Lambda_h^{-1} u^b_h{}^\top` with :math:`u = m` (mean) or :math:`u = m + L
        \varepsilon` (``"joint"``: one draw per sequence, output dimension and branch; branches with a shared
        posterior share :math:`\varepsilon`). So the small ``(H, s, C)`` coefficients
        :math:`\Lambda^{-1} u^\top C` are formed first and each branch costs one GEMM of inner dimension
        :math:`H s`: no ``(B, H, N, d_out)`` tensor. ``"marginal"`` sampling (independent :math:`u` per token,
        exact per-token marginals, no correlation across tokens) and the residual noise add per-token GP-output
        noise ``(B, H, N, d_out)``, mapped by :math:`C` too.
        """
        branches = self._branch_scores(scores, is_cross)
        maps = self._output_maps(len(branches))
        inverse = scores.singular_values.reciprocal()  # (H, s), or (B, H, s) in exact mode
        batch, length = scores.left.shape[0], scores.left.shape[-2]
        output = self.out_proj.bias
        noise = None
        for index, ((branch_scores, residual), posterior, output_map) in enumerate(
            zip(branches, self._branch_posteriors(), maps, strict=False)  # one branch: tie_qk or cross-attention
        ):
            distribution = posterior()
            draw = distribution.mean  # shape: (H, d_out, s)
            extra = None  # per-token GP-output noise: (B, H, N, d_out)
            if sample:
                root = distribution.lazy_covariance_matrix.root_decomposition().root.to_dense()  # (H, d_out, s, s)
                if noise is None or not self.shared_posterior:
                    tokens = (length,) if self.sampling_mode == "marginal" else ()
                    shape = (batch, self.num_heads, *tokens, *draw.shape[-2:])
                    noise = torch.randn(shape, dtype=draw.dtype, device=draw.device)
                if self.sampling_mode == "joint":
                    draw = draw + (root @ noise.unsqueeze(-1)).squeeze(-1)  # u = m + L eps: (B, H, d_out, s)
                else:  # one draw of u per token: O(N s^2 d_out)
                    per_token = torch.einsum("hcst,bhnct->bhncs", root, noise)  # (B, H, N, d_out, s)
                    interp = branch_scores * inverse.unsqueeze(-2)  # e Lambda^{-1}: (B, H, N, s)
                    extra = (interp.unsqueeze(-2) * per_token).sum(-1)
                if residual is not None:
                    # sqrt of the residual floored at eps: d sqrt(r) / dr stays finite where the residual is ~ 0
                    standard_deviation = residual.clamp_min(torch.finfo(residual.dtype).eps).sqrt()
                    residual_noise = standard_deviation.unsqueeze(-1) * torch.randn(
                        (batch, self.num_heads, length, self.num_outputs), dtype=draw.dtype, device=draw.device
                    )
                    extra = residual_noise if extra is None else extra + residual_noise
            # Lambda^{-1} u^T C: (H, s, C) or (B, H, s, C)
            coefficients = inverse.unsqueeze(-1) * (draw.mT @ output_map)
            output = self.accumulate_heads(output, self._mix_tokens(branch_scores, index), coefficients)
            if extra is not None:
                output = output + torch.einsum("bhnd,hdc->bnc", self._mix_tokens(extra, index), output_map)
        return output

    def _scores(self, x: Tensor, mask, context) -> tuple[AttentionScores, bool]:
        inputs = self._prepare(x, mask, context)
        if self.merge == "concat_tokens" and (inputs.key_mask is not None or inputs.causal or inputs.is_cross):
            raise ValueError("merge='concat_tokens' supports plain self-attention only (no mask, no context)")
        scores = self.features.scores(
            inputs.queries,
            inputs.keys,
            inputs.key_mask,
            inputs.causal,
            objective=self.training,
            kernel_diag=self.residual == "diag",
        )
        if self.features.mode == "exact":
            # a sequence whose kernel has rank < s has Lambda_k = 0: floor the per-sequence Lambda at
            # sqrt(eps) Lambda_1 so that e Lambda^{-1} (= H_e Lambda / Lambda) and the prior N(0, Lambda^2) of the KL
            # stay finite; the floored directions carry scores ~ 0 and contribute nothing to the output
            values = scores.singular_values
            floor = (values[..., :1] * torch.finfo(values.dtype).eps ** 0.5).clamp_min(torch.finfo(values.dtype).tiny)
            scores = dataclasses.replace(scores, singular_values=torch.maximum(values, floor))
        self._last_singular_values = scores.singular_values
        if self.training:
            self.update_added_loss_term(
                "ksvd_loss", KSVDAddedLossTerm(scores.objective, self.ksvd_weight, num_averaged_dims=1)
            )
        return scores, inputs.is_cross

    def forward(self, x: Tensor, mask: Tensor | str | None = None, context: Tensor | None = None) -> Tensor:
        scores, is_cross = self._scores(x, mask, context)
        return self.dropout(self._output(scores, is_cross, sample=self.sampling))

    # -- probabilistic interface -----------------------------------------------------------------------------------
    def learned_spectrum(self) -> Tensor | None:
        """The learned KSVD singular values per head, shape ``(H, s)``; ``None`` with ``features="exact"`` (recomputed
        per sequence, nothing learned)."""
        return None if self.features.mode == "exact" else self.features.singular_values.detach()

    def kl_divergence(self) -> Tensor:
        r""":math:`\sum_{h, c, \text{branch}} \mathrm{KL}(q(u) \| \mathcal N(0, \Lambda^2))`, a scalar; in exact mode
        :math:`\Lambda` is the last batch's and the KL is averaged over its sequences."""
        if self.features.mode == "exact":
            if self._last_singular_values is None:
                raise RuntimeError("with features='exact' the prior depends on the sequence: call forward() first")
            prior_variances = self._last_singular_values.pow(2).unsqueeze(-2)  # (B, H, 1, s)
        else:
            prior_variances = self.features.singular_values.pow(2).unsqueeze(-2)  # (H, 1, s)
        total = 0.0
        for posterior in self._posteriors():
            distribution = posterior()
            kl = diagonal_prior_kl(distribution.mean, distribution.lazy_covariance_matrix, prior_variances)
            total = total + (kl.sum(dim=(-2, -1)).mean() if kl.dim() == 3 else kl.sum())
        return total

    def posterior(
        self, x: Tensor, mask: Tensor | str | None = None, context: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        r"""Predictive mean and variance of the layer's output, each ``(B, N, C)`` (dropout off).

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
            scores, is_cross = self._scores(x, mask, context)
            mean = self._output(scores, is_cross, sample=False)
            variance = self._output_variance(scores, is_cross)
        finally:
            self.train(previous)
        return mean, variance

    def _output_variance(self, scores: AttentionScores, is_cross: bool) -> Tensor:
        branches = self._branch_scores(scores, is_cross)
        weights = self._output_maps(len(branches))  # C^b_{h,c,j}: (H, d_out, C) per branch
        inverse = scores.singular_values.reciprocal().unsqueeze(-2)
        roots = []
        for (branch_scores, _), posterior in zip(branches, self._branch_posteriors(), strict=False):
            root = posterior().lazy_covariance_matrix.root_decomposition().root.to_dense()  # (H, d_out, s, s)
            # e Lambda^{-1} L_c: (B, H, N, d_out, s)
            roots.append(torch.einsum("bhns,hcst->bhnct", branch_scores * inverse, root))
        variance = 0.0
        pairs = [(a, b) for a in range(len(roots)) for b in range(len(roots)) if a == b or self.shared_posterior]
        for a, b in pairs:
            inner = (roots[a] * roots[b]).sum(-1)  # (B, H, N, d_out)
            variance = variance + torch.einsum("bhnc,hcj,hcj->bnj", inner, weights[a], weights[b])
        for (_, residual), weight in zip(branches, weights, strict=True):
            if residual is not None:
                variance = variance + torch.einsum("bhn,hcj->bnj", residual, weight.pow(2))
        return variance
