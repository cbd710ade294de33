"""Sparse Gaussian process attention (SGPA, Chen & Li 2023): a decoupled SVGP whose amortised inducing inputs are the
keys, plus learned global inducing keys."""

from __future__ import annotations

import math

import torch
from gpytorch.constraints import Positive
from linear_operator.utils.cholesky import psd_safe_cholesky
from torch import Tensor

from ..kernels import padding_filled, safe_max_logit, squared_distance
from ..mlls import SequenceKLAddedLossTerm
from ..validation import check_choice, check_float, check_int, check_overflow, initialize_positive
from ._base import AttentionInputs, AttentionLayer

KERNELS = ("ard", "exponential")
#: How :class:`SGPAAttention` weights the two parts of its KL divergence (see its docstring).
KL_WEIGHTINGS = ("elbo", "official")


class SGPAAttention(AttentionLayer):
    r"""Sparse Gaussian process attention (SGPA, Chen & Li, ICLR 2023), docs/math.md section 5.

    Per head a symmetric kernel on the shared query/key projection :math:`k = W_k x` (:math:`W_q = W_k`, so the
    kernel is a valid PSD deep kernel), either ARD or exponential:

    .. math::

        \kappa_{\mathrm{ard}}(x, y) = s_f^2 \exp\big(-\tfrac12 \|(x - y) / \ell\|^2\big), \qquad
        \kappa_{\exp}(x, y) = s_f^2 \exp\big(\langle x / \ell, y / \ell \rangle\big),

    with learned per-head lengthscales :math:`\ell \in \mathbb R^{C/H}` and scale :math:`s_f`. The output of a head is
    a decoupled SVGP: the amortised inducing inputs are the keys :math:`k_g` with mean weights :math:`v_g = W_v x`
    (the values), and :math:`M_g` learned global inducing keys :math:`k_b` carry mean weights :math:`v_b` and a
    whitened covariance :math:`S = L_S L_S^\top` (one factor per head, shared by the value dimensions):

    .. math::

        \mu(q) &= K_{qg} v_g - K_{qb} K_{bb}^{-1} K_{bg} v_g + K_{qb} v_b, \\
        \sigma^2(q) &= \mathrm{diag}\big(K_{qq} - K_{qb} K_{bb}^{-1} K_{bq}
            + K_{qb} L_{bb}^{-\top} S L_{bb}^{-1} K_{bq}\big),

    where :math:`L_{bb}` is the Cholesky factor of :math:`K_{bb}` (with jitter ``jitter`` times its mean diagonal, used
    everywhere :math:`K_{bb}` appears). A sample (training, or :func:`~gpattn.attention._base.sample_attention`) is
    :math:`\mu + \sqrt{\sigma^2 + \text{jitter}}\,\varepsilon` with independent noise per token and value dimension,
    as in the official code; in eval mode the output is :math:`\mu`. The KL per value dimension is

    .. math::

        \tfrac12 \big[\mathrm{Tr}\, S - M_g - \log|S| + v_b^\top K_{bb} v_b
            + v_g^\top (K_{gg} - K_{gb} K_{bb}^{-1} K_{bg}) v_g\big],

    summed over value dimensions and heads: :math:`\mathrm{KL}_{\text{global}}` (the :math:`S` and :math:`v_b`
    terms, those of the global :math:`q(u)`) plus :math:`\mathrm{KL}_{v_g, b}` (the :math:`v_g` term, which belongs to
    each sequence :math:`b`: its amortised posterior). ``kl_weighting`` chooses how the training loss weights them.
    Every ``forward`` refreshes the added loss term ``"sequence_kl"`` (:class:`~gpattn.mlls.SequenceKLAddedLossTerm`,
    averaged over the batch with weight 1 per sequence, not divided by ``num_data``; still attached to the autograd
    graph), and :class:`~gpattn.mlls.AttentionELBO` multiplies it by :math:`\beta` and divides
    :meth:`kl_divergence` by the training-set size :math:`n`:

    * ``"elbo"`` (default): :meth:`kl_divergence` is :math:`\mathrm{KL}_{\text{global}}` and ``"sequence_kl"`` is
      :math:`\mathrm{KL}_{v_g, b}`, so that the loss is the negative ELBO of a data set of :math:`n` sequences
      (global KL once, local KLs once per sequence), per sequence:

      .. math::

          \operatorname{mean}_b \big(-\log p(y_b \mid F)\big)
              + \frac{\beta}{n} \mathrm{KL}_{\text{global}} + \beta \operatorname{mean}_b \mathrm{KL}_{v_g, b}.

    * ``"official"``: the official code's loss, which adds the whole KL, global part included, to every sequence:
      :meth:`kl_divergence` is 0 and ``"sequence_kl"`` is :math:`\mathrm{KL}_{\text{global}} + \mathrm{KL}_{v_g, b}`,

      .. math::

          \operatorname{mean}_b \big(-\log p(y_b \mid F)\big)
              + \beta\, \mathrm{KL}_{\text{global}} + \beta \operatorname{mean}_b \mathrm{KL}_{v_g, b},

      i.e. :math:`n` times the ELBO's weight on the global part (the official recipe anneals :math:`\beta` from 0
      to 1, the ``sgpa`` row's :class:`~gpattn.methods.TrainingRecipe`). docs/guide/papers.md compares the two.

    **Numerics.** The ARD kernel is translation invariant, so the tokens are centred on the first real key of their
    sequence before the projection, :math:`W_k (x - t)`, and the global keys are moved into that frame,
    :math:`k_b - W_k t`; its squared distances are :func:`~gpattn.kernels.squared_distance`'s (centred expansion,
    exact zero diagonal). The output is then as accurate at a constant offset of the tokens as at the origin (in
    float32 up to offsets of :math:`10^6`, in float64 up to :math:`10^{12}`, and beyond as long as the values'
    quadratic forms stay finite), whereas the plain expansion :math:`\lVert a \rVert^2 + \lVert b \rVert^2 - 2
    \langle a, b \rangle` loses 2 % of the output at an offset of :math:`10^3` in float32. The exponential kernel is
    not translation invariant and is computed as it stands. A NaN or an infinity in the results raises a
    ``ValueError`` when the tokens exceed :func:`~gpattn.validation.token_magnitude_limit` (about
    :math:`\sqrt{f_{\max}} / 10^3`) or, for the exponential kernel, when its logits reach the clamp
    (:func:`~gpattn.kernels.safe_max_logit`). float16 and bfloat16 layers (and ``torch.autocast``) project the
    tokens in their precision and compute the GP (kernel matrices, the Cholesky factor of :math:`K_{bb}`, the solves
    and the KL) in float32, with autocast off: LAPACK has no half-precision Cholesky. Mean and variance are cast back
    to the tokens' dtype; the KL terms stay in float32.

    Masks: padded keys leave the amortised set (their :math:`v_g` rows are zeroed, which removes them from
    :math:`K_{qg} v_g`, :math:`K_{bg} v_g` and the KL). Causal: query :math:`i` uses the amortised set
    :math:`\{j \le i\}`, i.e. the N x N matrix :math:`K_{qg} - K_{qb} K_{bb}^{-1} K_{bg}` is masked to its lower
    triangle; the KL's :math:`v_g` term uses the full sequence (the last query's set). Cross-attention: the
    queries come from ``x`` and keys and values from ``context`` (same projections).

    :param embed_dim: Token width :math:`C`.
    :param num_heads: Number of heads :math:`H`.
    :param num_inducing: :math:`M_g`, the number of global inducing keys per head.
    :param kernel: ``"ard"`` or ``"exponential"``.
    :param dropout: Dropout on the output.
    :param jitter: Relative jitter on :math:`K_{bb}` (times the mean of its diagonal) and on the sampling variance.
    :param kl_weighting: ``"elbo"`` or ``"official"``, the weights of the two parts of the KL (above).

    .. note:: Cost per head and sequence: O(N M p) for :math:`K_{qg}` (:math:`p = C / H`, :math:`M` keys), O((N + M)
        M_g^2) for the triangular solves, O(M_g^3) for the Cholesky of :math:`K_{bb}`; with self-attention
        O(N^2 p + N M_g^2 + M_g^3). A causal mask adds O(N^2 M_g) for the masked N x N correction; cross-attention
        adds O(M^2 p) for :math:`K_{gg}` in the KL.
    """

    is_stochastic = True

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        num_inducing: int = 16,
        kernel: str = "ard",
        dropout: float = 0.0,
        jitter: float = 1e-6,
        kl_weighting: str = "elbo",
    ):
        super().__init__(embed_dim, num_heads, dropout)
        num_inducing = check_int("num_inducing", num_inducing, where=type(self).__name__)
        check_choice("kernel", kernel, KERNELS, where=type(self).__name__)
        check_float("jitter", jitter, 0.0, 1.0, strict_maximum=True, where=type(self).__name__)
        check_choice("kl_weighting", kl_weighting, KL_WEIGHTINGS, where=type(self).__name__)
        self.kernel_type = kernel
        self.kl_weighting = kl_weighting
        self.num_inducing = num_inducing
        self.jitter = float(jitter)
        heads, width = num_heads, self.head_dim
        self.key_proj = torch.nn.Linear(embed_dim, embed_dim, bias=False)  # W_q = W_k: a symmetric kernel
        self.value_proj = torch.nn.Linear(embed_dim, embed_dim, bias=False)
        self.inducing_keys = torch.nn.Parameter(torch.randn(heads, num_inducing, width))  # k_b
        self.inducing_values = torch.nn.Parameter(1e-3 * torch.randn(heads, num_inducing, width))  # v_b
        # raw L_S: strict lower triangle as is, diagonal through exp; zeros give S = I (q(u) = p(u) whitened)
        self.chol_variational_covar = torch.nn.Parameter(torch.zeros(heads, num_inducing, num_inducing))
        # ARD: ||x - y||^2 ~ 2p for unit-scale features; exponential: <x, y> / sqrt(p), the softmax numerator
        lengthscale = math.sqrt(width) if kernel == "ard" else width**0.25
        self.register_parameter("raw_lengthscale", torch.nn.Parameter(torch.zeros(heads, width)))
        self.register_constraint("raw_lengthscale", Positive())
        self.register_parameter("raw_outputscale", torch.nn.Parameter(torch.zeros(heads)))
        self.register_constraint("raw_outputscale", Positive())
        self.initialize(lengthscale=lengthscale, outputscale=1.0)
        self.register_added_loss_term("sequence_kl")

    # -- parameters --------------------------------------------------------------------------------------------------
    @property
    def lengthscale(self) -> Tensor:
        """ARD lengthscales :math:`\\ell`, shape ``(H, C / H)``."""
        return self.raw_lengthscale_constraint.transform(self.raw_lengthscale)

    @lengthscale.setter
    def lengthscale(self, value: Tensor | float) -> None:
        initialize_positive(self, "raw_lengthscale", "lengthscale", value, type(self).__name__)

    @property
    def outputscale(self) -> Tensor:
        """Kernel amplitude :math:`s_f^2`, shape ``(H,)``."""
        return self.raw_outputscale_constraint.transform(self.raw_outputscale)

    @outputscale.setter
    def outputscale(self, value: Tensor | float) -> None:
        initialize_positive(self, "raw_outputscale", "outputscale", value, type(self).__name__)

    @property
    def variational_covar_root(self) -> Tensor:
        """:math:`L_S`, lower triangular with a positive diagonal, shape ``(H, M_g, M_g)``."""
        raw = self.chol_variational_covar
        return raw.tril(-1) + torch.diag_embed(raw.diagonal(dim1=-2, dim2=-1).exp())

    # -- kernel ------------------------------------------------------------------------------------------------------
    def kernel(self, left: Tensor, right: Tensor, same: bool = False) -> Tensor:
        """Kernel matrix per head: ``left`` ``(..., H, n, p)``, ``right`` ``(..., H, m, p)`` -> ``(..., H, n, m)``,
        in the dtype of ``left`` (the parameters are cast to it). The ARD kernel's squared distances are
        :func:`~gpattn.kernels.squared_distance`'s (centred; ``same=True``: ``right`` is ``left``, zero diagonal)."""
        scale = self.lengthscale.to(left.dtype).unsqueeze(-2)  # shape: (H, 1, p)
        outputscale = self.outputscale.to(left.dtype)[:, None, None]  # shape: (H, 1, 1)
        left = left / scale
        right = left if same else right / scale
        if self.kernel_type == "exponential":
            # logits clamped as in ExponentialDotProductKernel, so that K itself cannot overflow
            return outputscale * torch.exp((left @ right.mT).clamp_max(safe_max_logit(left.dtype)))
        return outputscale * torch.exp(-0.5 * squared_distance(left, right, same=same))

    def kernel_diag(self, tokens: Tensor) -> Tensor:
        """:math:`\\kappa(x, x)` per token: ``(..., H, n, p)`` -> ``(..., H, n)``."""
        outputscale = self.outputscale.to(tokens.dtype)[:, None]  # shape: (H, 1)
        if self.kernel_type == "exponential":
            return outputscale * torch.exp(self._self_logits(tokens).clamp_max(safe_max_logit(tokens.dtype)))
        return outputscale.expand(tokens.shape[:-1])

    def _self_logits(self, tokens: Tensor) -> Tensor:
        # <x / l, x / l> per token, the exponential kernel's diagonal logits (before the clamp); shape: (..., H, n)
        return (tokens / self.lengthscale.to(tokens.dtype).unsqueeze(-2)).square().sum(-1)

    def _inducing_cholesky(self, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """:math:`L_{bb}` of the jittered :math:`K_{bb}`, shape ``(H, M_g, M_g)``, and the jitter, shape ``(H,)``, in
        ``dtype`` (default: the parameters')."""
        inducing_keys = self.inducing_keys.to(dtype or self.inducing_keys.dtype)
        induc_induc_covar = self.kernel(inducing_keys, inducing_keys, same=True)  # shape: (H, M_g, M_g)
        jitter = self.jitter * induc_induc_covar.diagonal(dim1=-2, dim2=-1).mean(-1).detach()  # shape: (H,)
        eye = torch.eye(self.num_inducing, dtype=jitter.dtype, device=jitter.device)
        return psd_safe_cholesky(induc_induc_covar + jitter[:, None, None] * eye), jitter

    # -- GP ----------------------------------------------------------------------------------------------------------
    def _global_kl(self, induc_chol: Tensor) -> Tensor:
        # 1/2 [Tr S - M_g - log|S| + v_b^T K_bb v_b] summed over heads and value dims (S is shared by the p dims)
        dtype = induc_chol.dtype
        covar_root = self.variational_covar_root.to(dtype)
        log_det = 2 * self.chol_variational_covar.to(dtype).diagonal(dim1=-2, dim2=-1).sum(-1)  # log|S|; shape: (H,)
        covar_term = covar_root.square().sum((-2, -1)) - self.num_inducing - log_det
        mean_term = (induc_chol.mT @ self.inducing_values.to(dtype)).square().sum((-2, -1))  # ||L_bb^T v_b||^2
        return 0.5 * (self.head_dim * covar_term + mean_term).sum()

    def _moments(self, inputs: AttentionInputs, with_kl: bool) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """Per-head mean and variance ``(B, H, N, p)`` in the tokens' dtype, the sampling jitter ``(H, 1, 1)`` and
        (``with_kl``) the KL of every sequence that the added loss term ``"sequence_kl"`` carries, ``(B,)``."""
        token_dtype = inputs.queries.dtype
        # padding set to the first real token t: it moves neither the centring of the squared distances nor the
        # exponential kernel's range check
        keys_in, origin = padding_filled(inputs.keys, inputs.key_mask)  # t; shape: (B, 1, C)
        queries_in, shift = inputs.queries if inputs.is_cross else keys_in, None
        if self.kernel_type == "ard":  # translation invariant: centre the tokens on one of them before projecting
            queries_in, keys_in = queries_in - origin, keys_in - origin
            shift = self.split_heads(self.key_proj(origin))  # W_k t; shape: (B, H, 1, p)
        queries = self.split_heads(self.key_proj(queries_in))  # shape: (B, H, N, p)
        keys = self.split_heads(self.key_proj(keys_in)) if inputs.is_cross else queries  # shape: (B, H, M, p)
        values = self.split_heads(self.value_proj(inputs.keys))  # v_g; shape: (B, H, M, p)
        # the GP in float32 at least (LAPACK has no half-precision Cholesky), with autocast off; cast back at the end
        dtype = torch.promote_types(values.dtype, torch.float32)
        with torch.autocast(values.device.type, enabled=False):
            queries, keys, values = queries.to(dtype), keys.to(dtype), values.to(dtype)
            if inputs.key_mask is not None:  # padded keys leave the amortised set
                values = values * inputs.key_mask[:, None, :, None].to(dtype)
            induc_chol, jitter = self._inducing_cholesky(dtype)
            inducing_keys = self.inducing_keys.to(dtype)
            if shift is not None:  # k_b in the centred frame: kappa(q - W_k t, k_b - W_k t) = kappa(q, k_b)
                inducing_keys = inducing_keys - shift.to(dtype)  # shape: (B, H, M_g, p)

            query_induc_covar = self.kernel(queries, inducing_keys)  # K_qb; shape: (B, H, N, M_g)
            query_key_covar = self.kernel(queries, keys, same=not inputs.is_cross)  # K_qg; shape: (B, H, N, M)
            query_interp = torch.linalg.solve_triangular(induc_chol, query_induc_covar.mT, upper=False)  # L^-1 K_bq
            if inputs.is_cross:
                key_induc_covar = self.kernel(keys, inducing_keys)  # K_gb; shape: (B, H, M, M_g)
                key_interp = torch.linalg.solve_triangular(induc_chol, key_induc_covar.mT, upper=False)
            else:
                key_interp = query_interp  # L^{-1} K_bg; shape: (B, H, M_g, M)
            interp_values = key_interp @ values  # L^{-1} K_bg v_g; shape: (B, H, M_g, p)

            if inputs.causal:  # query i: amortised set {j <= i}
                mean = (query_key_covar - query_interp.mT @ key_interp).tril() @ values
            else:  # K_qg v_g - K_qb K_bb^{-1} K_bg v_g
                mean = query_key_covar @ values - query_interp.mT @ interp_values
            mean = mean + query_induc_covar @ self.inducing_values.to(dtype)  # + K_qb v_b

            # diag of K_qq - K_qb K_bb^{-1} K_bq + K_qb L^{-T} S L^{-1} K_bq
            variational_interp = self.variational_covar_root.to(dtype).mT @ query_interp  # L_S^T L^{-1} K_bq
            variance = self.kernel_diag(queries) - query_interp.square().sum(-2) + variational_interp.square().sum(-2)
            variance = variance.clamp_min(0)  # shape: (B, H, N)

            data_kl = None
            if with_kl:  # 1/2 v_g^T (K_gg - K_gb K_bb^{-1} K_bg) v_g per sequence, summed over heads and value dims
                key_key_covar = self.kernel(keys, keys, same=True) if inputs.is_cross else query_key_covar
                quad = (values * (key_key_covar @ values)).sum((-3, -2, -1)) - interp_values.square().sum((-3, -2, -1))
                data_kl = 0.5 * quad
                if self.kl_weighting == "official":  # the whole KL per sequence
                    data_kl = data_kl + self._global_kl(induc_chol)
        mean, variance = mean.to(token_dtype), variance.to(token_dtype)
        points = [queries, keys, inducing_keys] if inputs.is_cross else [queries, inducing_keys]
        self._check_range(inputs, (mean, variance, data_kl), points)
        return mean, variance.unsqueeze(-1).expand_as(mean), jitter[:, None, None].to(token_dtype), data_kl

    def _check_range(self, inputs: AttentionInputs, results: tuple[Tensor | None, ...], points: list[Tensor]) -> None:
        """Refuse inputs beyond the layer's range: a saturated exponential kernel (checked on every call, one small
        reduction over the points' own logits) and, once a result is not finite, tokens beyond
        :func:`~gpattn.validation.token_magnitude_limit` (one pass over each result on the normal path)."""
        where = f"{type(self).__name__} (kernel={self.kernel_type!r})"
        if self.kernel_type == "exponential":
            # <a, b> <= max(|a|^2, |b|^2): a logit reaches the clamp only if one point's own logit does, and every
            # point's own logit is used (the variance's K_qq, K_gg in the KL, K_bb)
            bound = safe_max_logit(points[0].dtype)
            with torch.no_grad():
                logit = float(torch.stack([self._self_logits(point).amax() for point in points]).amax())
            if logit >= bound:
                raise ValueError(
                    f"{where}: the kernel's logits <k / l, k / l> reach {logit:.3g}, beyond the clamp {bound:.3g} of "
                    f"{points[0].dtype} (safe_max_logit), where the exponential kernel saturates: K_bb loses its rank "
                    "and the KL its sign; rescale the inputs (e.g. a LayerNorm before the layer), use float64 or "
                    "kernel='ard'"
                )
        growth = f"the {'squared distances' if self.kernel_type == 'ard' else 'logits'} of the kernel and the KL's "
        check_overflow(
            results, (inputs.queries, inputs.keys), growth + "quadratic form in the values grow like |x|^2", where
        )

    # -- attention interface -----------------------------------------------------------------------------------------
    def forward(self, x: Tensor, mask: Tensor | str | None = None, context: Tensor | None = None) -> Tensor:
        mean, variance, jitter, data_kl = self._moments(self._prepare(x, mask, context), with_kl=True)
        self.update_added_loss_term("sequence_kl", SequenceKLAddedLossTerm(data_kl))
        if self.sampling:
            mean = mean + (variance + jitter).sqrt() * torch.randn_like(mean)
        return self.project_out(mean)

    def head_moments(
        self, x: Tensor, mask: Tensor | str | None = None, context: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Predictive mean and variance of every head before the output projection, each ``(B, H, N, C / H)``
        (the variance is the same for all value dimensions of a head). Does not touch the per-sequence KL term."""
        mean, variance, _, _ = self._moments(self._prepare(x, mask, context), with_kl=False)
        return mean, variance

    def posterior(
        self, x: Tensor, mask: Tensor | str | None = None, context: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Mean and variance of the output after ``out_proj`` (no dropout), each ``(B, N, C)``."""
        return self.project_out_moments(*self.head_moments(x, mask, context))

    def kl_divergence(self) -> Tensor:
        """The KL of the global :math:`q(u)` (:math:`S`, :math:`v_b`), a scalar (``kl_weighting="elbo"``), or 0
        (``"official"``, which adds it to every sequence's term instead); the per-sequence part is the added loss term
        ``"sequence_kl"`` of the last ``forward`` (:meth:`sequence_kl`). In float32 for a half-precision layer."""
        dtype = torch.promote_types(self.inducing_keys.dtype, torch.float32)
        if self.kl_weighting == "official":
            return torch.zeros((), dtype=dtype, device=self.inducing_keys.device)
        return self._global_kl(self._inducing_cholesky(dtype)[0])

    def sequence_kl(self) -> Tensor | None:
        """The KL of every sequence of the last ``forward``, shape ``(B,)`` (summed over heads and value dimensions):
        its :math:`v_g` term (``kl_weighting="elbo"``) or the whole KL, global part included (``"official"``); or
        ``None`` before any ``forward``."""
        term = self._added_loss_terms.get("sequence_kl")
        return None if term is None else term.objective
