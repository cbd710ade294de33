"""KEP-SVGP attention: a pair of kernel-eigen SVGPs per head (Chen, Tao, Tonin & Suykens, ICML 2024)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from gpytorch.variational import CholeskyVariationalDistribution
from torch import Tensor

from ..features import AttentionKernelEigenFeatures, KernelEigenScores, build_attention_features
from ..validation import check_bool, check_choice, check_int
from ..variational import KernelEigenPairVariationalStrategy, KernelEigenReadout, KernelEigenVariationalStrategy
from ._base import AttentionLayer

MERGES = ("sum", "concat", "concat_tokens")
SAMPLINGS = ("joint", "marginal")
RESIDUALS = ("none", "diag")


class KEPSVGPAttention(AttentionLayer):
    r"""Multi-head KEP-SVGP attention: two sparse variational GPs per head whose inducing variables are the
    projections on the KSVD's left and right singular vectors (docs/math.md section 3).

    Three parts and output maps: :attr:`features` (an :class:`~gpattn.features.AttentionKernelEigenFeatures` of the
    chosen mode) give per sequence and head the scores :math:`e(x)` at the queries, :math:`r(z)` at the keys and
    :math:`\Lambda`, and hold the KSVD penalty; :attr:`strategy` (the GPyTorch
    :class:`~gpattn.variational.KernelEigenPairVariationalStrategy`; the single-branch
    :class:`~gpattn.variational.KernelEigenVariationalStrategy` with ``tie_qk=True``) holds :math:`q(u)`, a
    ``CholeskyVariationalDistribution`` of batch ``(H, d_out, 2)`` (heads, the ``d_out`` GP outputs of a head,
    branches) against :math:`\mathcal N(0, \Lambda^2)`, and gives the KL; :attr:`readout`
    (:class:`~gpattn.variational.KernelEigenReadout`) pushes the strategy's :math:`q(f)` at the scores through the
    per-head maps :math:`d_{out} \to` head width and ``out_proj``: the output, its samples and :meth:`posterior`.
    With independent :math:`q(u_c) = \mathcal N(m_c, S_c)` per output :math:`c` of a head,

    .. math::

        F_e = e(X) \Lambda^{-1} u_e, \qquad F_r = r(X) \Lambda^{-1} u_r, \qquad
        \mathrm{KL} = \sum_{h, c, \text{branch}} \mathrm{KL}(q(u) \,\|\, \mathcal N(0, \Lambda^2)).

    Merging: ``"sum"`` :math:`F = F_e + F_r` (with ``shared_posterior=True`` the official code's :math:`(e + r)
    \Lambda^{-1} u` and one KL); ``"concat"`` :math:`[F_e, F_r]` and a map :math:`2 d_{out} \to` head width;
    ``"concat_tokens"`` the paper's token-axis :math:`W_{tok} [F_e; F_r]` (:math:`2N \to N`, needs ``max_len``).
    Sampling (training, or eval inside :func:`~gpattn.attention.sample_attention`; eval mode returns the mean):
    ``"joint"`` draws :math:`u = m + L \varepsilon` once per sequence, the exact joint distribution across tokens;
    ``"marginal"`` (the official code's) draws independent noise per token with the right marginals only.
    ``residual="diag"`` adds the residual variance :math:`k(x, x) - \|e(x)\|^2` per token. The KSVD penalty is the
    features' added loss term ``"ksvd_loss"``. In cross-attention the queries use the left branch alone (:math:`r`
    lives on the keys); ``tie_qk=True`` (the symmetric ablation, :math:`H_e = H_r`) uses one branch.

    :param embed_dim: Token width :math:`C`.
    :param num_heads: :math:`H`.
    :param num_inducing: :math:`s`, the KSVD rank (default :math:`\min(10, p)`, :math:`p` the feature dimension).
    :param features: A mode of :func:`~gpattn.features.build_attention_features` (the layer accepts the calls it
        supports): ``"amortized"`` (default), ``"primal_tokens"`` (the official :math:`W_{e|X} = \tilde X_h^\top
        \tilde W_e`), ``"primal_features"`` or ``"exact"`` (a :math:`\Lambda` per sequence: the KL is the last call's).
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
    :param feature_dim: Kernel feature dimension :math:`p` (default: the head width); ``num_inducing <= feature_dim``.
    :param ksvd_weight: :math:`\eta \geq 0`, the weight of the KSVD penalty :math:`\eta J^2`.
    :param ksvd_form: ``"sum"`` or ``"official"`` (``"primal_tokens"`` only); see :func:`~gpattn.ksvd.ksvd_objective`.
    :param feature_options: The feature mode's own options
        (:attr:`~gpattn.features.AttentionKernelEigenFeatures.options`), e.g. ``{"rank_multiple": 2, "padding":
        "included"}`` for ``"primal_tokens"`` as the official CoLA layer.

    The paper's configuration (registry row ``"kep_svgp_paper"``) is ``features="primal_tokens"``,
    ``shared_posterior=True``, ``sampling="marginal"``, ``num_outputs="num_inducing"``, ``ksvd_form="official"``;
    the official code's KL and its ``1/n``-less weight are *not* reproduced (docs/guide/papers.md).

    Example:
        >>> _ = torch.manual_seed(0)
        >>> layer, x = KEPSVGPAttention(embed_dim=16, num_heads=2, num_inducing=3), torch.randn(4, 9, 16)
        >>> layer.train()(x).shape, layer.kl_divergence()  # training: a joint sample; the KL of q(u)
        (torch.Size([4, 9, 16]), tensor(225.1222, grad_fn=<CholeskyPriorKLBackward>))
        >>> mean, variance = layer.posterior(x)  # the strategy's q(f) through the output maps, (B, N, C) each
        >>> variance.shape, bool((variance > 0).all())
        (torch.Size([4, 9, 16]), True)

    .. note:: Cost per head (amortised features, joint sampling): O(N C s + N p s) for the scores, O(N s d_out)
        for the output, O(s) for the prior terms of the KL, O(s^2 d_out) for its variational terms; no
        :math:`N \times N` matrix. Marginal sampling adds O(N s^2 d_out); exact features O(N M p + N M min(N, M)).
    """

    is_stochastic = True
    call_results = ("_call_kl",)  # the KL of the last forward call (features with a Lambda per call)

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
        feature_options: Mapping[str, Any] | None = None,
    ):
        super().__init__(embed_dim, num_heads, dropout)
        where = type(self).__name__
        check_choice("merge", merge, MERGES, where=where)
        check_choice("sampling", sampling, SAMPLINGS, where=where)
        check_choice("residual", residual, RESIDUALS, where=where)
        # flags, not truthiness: shared_posterior="no" or tie_qk="False" would switch the option on without a word
        shared_posterior = check_bool("shared_posterior", shared_posterior, where=where)
        tie_qk = check_bool("tie_qk", tie_qk, where=where)
        if tie_qk and (merge != "sum" or shared_posterior):
            raise ValueError(f"{where}: tie_qk=True uses one branch: merge must be 'sum' and shared_posterior False")
        if merge == "concat_tokens":  # max_len is required: None is refused too
            max_len = check_int("max_len (the sequence length of merge='concat_tokens')", max_len, where=where)
        kernel_features = build_attention_features(
            embed_dim, num_heads, num_inducing, features, kernel=kernel, feature_dim=feature_dim, tie_qk=tie_qk,
            max_len=max_len, ksvd_weight=ksvd_weight, ksvd_form=ksvd_form, **dict(feature_options or {}),
        )  # fmt: skip
        self.supports_causal = kernel_features.supports_causal
        self.supports_cross_attention = kernel_features.supports_cross_attention
        self.supports_graph_capture = kernel_features.supports_graph_capture
        self.num_inducing = num_inducing = kernel_features.num_inducing  # the default resolved there: min(10, p)
        num_outputs = num_inducing if num_outputs == "num_inducing" else num_outputs  # the official code's d_out = s
        self.num_outputs = check_int("num_outputs", self.head_dim if num_outputs is None else num_outputs, where=where)
        self.merge, self.residual, self.sampling_mode = merge, residual, sampling
        self.shared_posterior, self.tie_qk, self.max_len = shared_posterior, tie_qk, max_len
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
        self.readout = KernelEigenReadout(self.strategy)
        # m ~ N(0, Lambda^2) so that Lambda^{-1} m acts like a random value projection, S = (0.1 Lambda)^2
        learned = kernel_features.learns_spectrum  # features with a Lambda per sequence: q(u) at unit scale
        scale = kernel_features.singular_values.detach() if learned else torch.ones(num_heads, num_inducing)
        self.readout.initialize_at_prior_draw(scale, covariance_scale=0.1)
        width = 2 * self.num_outputs if merge == "concat" else self.num_outputs
        bound = width**-0.5
        # per-head output map d_out (or 2 d_out) -> head width; shape (H, width, head_dim)
        self.output_weight = torch.nn.Parameter(torch.empty(num_heads, width, self.head_dim).uniform_(-bound, bound))
        if merge == "concat_tokens":
            # token-axis merge [F_e; F_r] (2N) -> N per head, initialised at (F_e + F_r) / 2
            eye = torch.eye(max_len).expand(num_heads, -1, -1)
            self.token_weight = torch.nn.Parameter(0.5 * torch.cat([eye, eye], dim=-1))
        self._call_kl: Tensor | None = None  # the KL of the last forward call, when Lambda belongs to each call

    @property
    def features(self) -> AttentionKernelEigenFeatures:
        """The per-sequence kernel-eigen features (owned by :attr:`strategy`)."""
        return self.strategy.features

    def learned_spectrum(self) -> Tensor | None:
        r"""The learned KSVD singular values per head, shape ``(H, s)``, or ``None`` for features whose
        :math:`\Lambda` is not learned (exact: it belongs to each sequence)."""
        return self.features.singular_values.detach() if self.features.learns_spectrum else None

    # -- the pieces ----------------------------------------------------------------------------------------------------
    def _sides(self, is_cross: bool) -> tuple[str, ...]:
        # the branches evaluated at the queries: r lives on the keys in cross-attention; one branch when tied
        return ("left",) if (self.tie_qk or is_cross) else ("left", "right")

    def _output_maps(self, branches: int) -> Tensor:
        r"""The linear maps from the branches' GP outputs to the layer output: :math:`C^b_h = W^b_h P_h^\top` with the
        branch's rows :math:`W^b_h` of the per-head output map and the head block :math:`P_h` of ``out_proj`` (so
        ``y = b + sum_{b, h} F^b_h C^b_h``); one map ``(H, d_out, C)`` for every branch, or with ``merge="concat"`` a
        block of rows per branch, ``(branches, H, d_out, C)``."""
        projection = self.head_projection()  # (H, hd, C)
        if self.merge != "concat":
            return torch.bmm(self.output_weight, projection)  # (H, d_out, C); bmm: fewer operators than matmul
        rows = self.output_weight[:, : branches * self.num_outputs]  # a block of rows per branch
        return rows.unflatten(1, (branches, self.num_outputs)).movedim(1, 0) @ projection

    def _output(self, scores: KernelEigenScores, is_cross: bool, sample: bool) -> Tensor:
        r"""The output before dropout, ``(B, N, C)``, the mean or a sample: the readout's coefficients
        :math:`\Lambda^{-1} u^\top C` (``u = m`` or a joint draw) times the stacked scores :math:`[e^\top; r^\top]`
        in one GEMM of inner dimension :math:`2 H s` (:meth:`~gpattn.variational.KernelEigenReadout.linear_output`),
        plus the per-token noise of ``"marginal"`` and the residual, drawn after :math:`u`."""
        sides = self._sides(is_cross)
        maps = self._output_maps(len(sides))
        columns = scores.columns(sides)  # [e^T; r^T]: (B, branches, H, s, N)
        mixing = self.merge == "concat_tokens"  # W_tok [F_e; F_r]: its (H, N, N) blocks act along the tokens
        blocks = self.token_weight.unflatten(-1, (2, self.max_len)).movedim(-2, 0) if mixing else None
        columns = columns @ blocks.mT if mixing else columns  # on the scores: the outputs are linear in them
        draws = columns.shape[0] if sample and self.joint_sampling else None  # a joint u per sequence, or the mean
        output = self.readout.linear_output(columns.flatten(1, 3), self.out_proj.bias, maps, scores, sides, draws)
        if sample and (not self.joint_sampling or self.residual == "diag"):  # drawn after u
            marginal = not self.joint_sampling  # merge="sum": one draw for the sum of the branches
            summed = marginal and self.merge == "sum"
            fused = self.readout.summed_noise_output(scores, sides, maps) if summed and not mixing else None
            if fused is not None:  # the draw of token_noise(..., sum_sides=True) through the map, one function
                return output + fused
            noises = self.readout.token_noise(scores, sides, marginal, sum_sides=summed)
            for index, (side, output_map) in enumerate(zip(sides, maps.expand(len(sides), -1, -1, -1), strict=True)):
                if side in noises:  # per-token noise of the GP outputs: (B, H, d_out, N)
                    noise = blocks[index] @ noises[side].mT if mixing else noises[side].mT  # (B, H, N, d_out)
                    output = output + torch.einsum("bhnd,hdc->bnc", noise, output_map)
        return output

    def _features(self, x: Tensor, mask: Tensor | str | None, context: Tensor | None) -> tuple[KernelEigenScores, bool]:
        inputs = self._prepare(x, mask, context)
        if self.merge == "concat_tokens":
            if inputs.key_mask is not None or inputs.causal or inputs.is_cross:
                raise ValueError("merge='concat_tokens' supports plain self-attention only (no mask, no context)")
            if x.shape[-2] != self.max_len:
                raise ValueError(f"merge='concat_tokens' needs sequences of length {self.max_len}, got {x.shape[-2]}")
        diag = self.residual == "diag"  # the kernel diagonals serve the residual only; J serves training only
        scores = self.features(inputs.queries, inputs.keys, inputs.key_mask, inputs.causal, self.training, diag)
        return scores, inputs.is_cross

    def forward(self, x: Tensor, mask: Tensor | str | None = None, context: Tensor | None = None) -> Tensor:
        scores, is_cross = self._features(x, mask, context)
        if self.features.spectrum_per_call:  # the KL belongs to this call (the added-loss-term idiom), summed over
            kl = self.strategy.kl_divergence(scores).sum(dim=(-2, -1))  # heads and outputs: (B,), averaged
            self._call_kl = kl.mean()
        output = self._output(scores, is_cross, sample=self.sampling)
        return self.dropout(output) if self.dropout.p > 0 else output

    # -- probabilistic interface -----------------------------------------------------------------------------------
    @property
    def sampling_mode(self) -> str:
        """``"joint"`` or ``"marginal"`` sampling of the output (the ``sampling`` argument); assignable, e.g. to draw
        both kinds of samples from one trained layer."""
        return "joint" if self.joint_sampling else "marginal"

    @sampling_mode.setter
    def sampling_mode(self, sampling: str) -> None:
        check_choice("sampling", sampling, SAMPLINGS, where=type(self).__name__)
        self.joint_sampling = sampling == "joint"

    def kl_divergence(self) -> Tensor:
        r""":math:`\sum_{h, c, \text{branch}} \mathrm{KL}(q(u) \| \mathcal N(0, \Lambda^2))`, a scalar: the strategy's
        KL summed over heads and outputs. With features whose :math:`\Lambda` belongs to each sequence (exact), the KL
        of the last ``forward`` call, averaged over its sequences (computed by that call; :meth:`posterior` and
        :meth:`~gpattn.attention.AttentionLayer.predictive_mean` leave it unchanged). In the dtype of :math:`q(u)`: a
        half-precision layer's KL is computed and returned in half precision (SGPA computes its KL in float32)."""
        if not self.features.spectrum_per_call:
            return self.readout.kl_divergence()
        if self._call_kl is None:
            raise RuntimeError(
                f"{type(self).__name__}: with features={self.features.mode!r} the prior belongs to each sequence: "
                "call the features (the layer) on a batch first; kl_divergence() is then that call's KL"
            )
        return self._call_kl

    def posterior(
        self, x: Tensor, mask: Tensor | str | None = None, context: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        r"""Predictive mean and variance of the layer's output, each ``(B, N, C)`` (dropout off): the strategy's
        :math:`q(f)` at the tokens pushed through the output maps
        (:meth:`~gpattn.variational.KernelEigenReadout.output_variance`)."""
        if self.merge == "concat_tokens":
            raise NotImplementedError("posterior() is not available for merge='concat_tokens' (token mixing)")
        with self.as_in_eval():
            scores, is_cross = self._features(x, mask, context)
            sides = self._sides(is_cross)
            maps = self._output_maps(len(sides)).expand(len(sides), -1, -1, -1)
            variance = self.readout.output_variance(scores, sides, list(maps))
            return self._output(scores, is_cross, sample=False), variance
