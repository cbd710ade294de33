"""Correlated Gaussian process attention (CGPT, Bui et al. 2024): the attention kernel is the cross-covariance of a
query GP and a key GP made dependent through a shared latent GP."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from gpytorch.constraints import GreaterThan, Positive
from linear_operator.utils.errors import NotPSDError
from torch import Tensor

from ..kernels import padding_filled, squared_distance
from ..mlls import CGPAddedLossTerm
from ..validation import check_float, check_overflow, check_positive, initialize_positive
from ._base import AttentionInputs, AttentionLayer

#: what overflows at large tokens, for the messages of the magnitude guard
GROWTH = "the squared distances of its RBF kernels grow like |x|^2"
#: the positive scales of a head: the amplitude a^2 of the three GPs, and the query and key GPs' prior variances
#: relative to the latent GP's (sigma_q^2, sigma_k^2 >= 1 keep their conditional covariances given z_0 PSD)
SCALES = {
    "outputscale": Positive,
    "query_variance_ratio": lambda: GreaterThan(1.0),
    "key_variance_ratio": lambda: GreaterThan(1.0),
}


def _rbf(left: Tensor, right: Tensor | None = None) -> Tensor:
    """The standardised RBF kernel :math:`\\kappa(a, b) = \\exp(-\\lVert a - b \\rVert^2 / 2)` on
    :func:`~gpattn.kernels.squared_distance` (``right=None``: ``right`` is ``left``, with an exact unit diagonal).

    :param left: shape ``(..., n, p)``.
    :param right: shape ``(..., m, p)``.
    :return: shape ``(..., n, m)``.
    """
    return torch.exp(-0.5 * squared_distance(left, left if right is None else right, same=right is None))


def _restrict(covar: Tensor, row_mask: Tensor | None, col_mask: Tensor | None) -> Tensor:
    """Zero the rows and columns of padded tokens (masks ``(B, 1, n)`` and ``(B, 1, m)``, ``True`` = real)."""
    if row_mask is not None:
        covar = covar * row_mask.unsqueeze(-1)
    if col_mask is not None:
        covar = covar * col_mask.unsqueeze(-2)
    return covar


def _decouple(covar: Tensor, mask: Tensor | None, variance: Tensor | float) -> Tensor:
    """A prior covariance ``(B, H, n, n)`` whose padded tokens are independent of the others with variance
    ``variance``: the real block, and thus every solve and factor restricted to it, is that of the real tokens."""
    if mask is None:
        return covar
    keep = mask.unsqueeze(-1) & mask.unsqueeze(-2)  # shape: (B, 1, n, n)
    eye = torch.eye(covar.shape[-1], dtype=covar.dtype, device=covar.device)
    return torch.where(keep, covar, variance * eye)


@dataclass
class _Latent:
    """The latent-GP part shared by the mean, the variance, the samples and the objective of one call."""

    tokens: tuple[Tensor, Tensor]  # the input queries and keys, for the magnitude guard
    queries: Tensor  # q = W_q (x - t), centred; shape: (B, H, N, p)
    keys: Tensor  # k = W_k (x - t), centred; shape: (B, H, M, p)
    values: Tensor  # v = W_v x, padded keys zeroed; shape: (B, H, M, p)
    query_mask: Tensor | None  # shape: (B, 1, N); None in cross-attention
    key_mask: Tensor | None  # shape: (B, 1, M)
    query_interp: Tensor  # L_00^{-1} K_0q of the unit-amplitude GPs; shape: (B, H, M, N)
    key_interp: Tensor  # L_00^{-1} K_0k of the unit-amplitude GPs; shape: (B, H, M, M)
    amplitude: Tensor  # a^2; shape: (H, 1, 1)
    mean: Tensor  # K_qk v; shape: (B, H, N, p)


class CGPTAttention(AttentionLayer):
    r"""Correlated Gaussian process attention (CGPT; Bui, Tran, Dinh, Nguyen & Hoang, UAI 2024, arXiv:2502.20525).

    Per head, three projections of the tokens, :math:`q = W_q x`, :math:`k = W_k x` and :math:`x_0 = W_0 x`, are the
    inputs of three GPs built on the standardised RBF kernel :math:`\kappa(a, b) = \exp(-\lVert a - b \rVert^2 / 2)`.
    Write :math:`K_{ab} = \kappa(a, b)` for its matrices, :math:`K_{qq} = \sigma_q^2 \kappa(q, q)` and
    :math:`K_{kk} = \sigma_k^2 \kappa(k, k)`. A latent GP :math:`z_0 \sim \mathcal{GP}(0, a^2 \kappa)` lives on
    :math:`x_0`; the query GP :math:`z_q` and the key GP :math:`z_k` are conditionally independent given :math:`z_0`,

    .. math::

        z_q \mid z_0 \sim \mathcal N\big(K_{q0} K_{00}^{-1} z_0,\; a^2 \Sigma_q\big), \qquad
        \Sigma_q = K_{qq} - K_{q0} K_{00}^{-1} K_{0q}

    (likewise :math:`z_k`), so that :math:`\mathrm{Cov}(z_q) = a^2 K_{qq}`, :math:`\mathrm{Cov}(z_k) = a^2 K_{kk}`
    and the two GPs are correlated through :math:`z_0` with the asymmetric cross-covariance
    :math:`a^2 K_{qk}`, where

    .. math::

        K_{qk} = K_{q0} K_{00}^{-1} K_{0k}.

    The attention of a head is the CGP prediction of :math:`z_q` given the key observations :math:`z_k = K_{kk} v`
    (:math:`v = W_v x`; one independent GP per value dimension, all sharing the covariance):

    .. math::

        \mu = K_{qk} K_{kk}^{-1} z_k = K_{qk} v, \qquad
        \mathrm{Cov}(z_q \mid z_k) = a^2 \big(K_{qq} - K_{qk} K_{kk}^{-1} K_{kq}\big).

    The amplitude :math:`a^2` (``outputscale``) scales the uncertainty and leaves the mean alone; the official code's
    standardised kernel is :math:`a^2 = 1` and its mean is :math:`\mu`. In eval mode ``forward`` returns :math:`\mu`;
    in training (or inside :func:`~gpattn.attention.sample_attention`) an exact joint sample across the tokens, drawn
    by Matheron's rule from the generative construction (no factorisation of the predictive covariance): with
    unit-amplitude prior draws :math:`z_0' = L_{00} \varepsilon_0`, :math:`z_q' = K_{q0} K_{00}^{-1} z_0' + L_q
    \varepsilon_q`, :math:`z_k' = K_{k0} K_{00}^{-1} z_0' + L_k \varepsilon_k` (:math:`L_s L_s^\top = \Sigma_s`), the
    sample is :math:`\mu + a\,(z_q' - K_{qk} K_{kk}^{-1} z_k')`. :meth:`posterior` gives :math:`\mu` and the
    diagonal of the predictive covariance pushed through ``out_proj``; :meth:`head_covariance` the covariance itself.

    **Training term.** The CGP regulariser is the negative log-likelihood of the attention outputs under the
    correlated prior, in expectation over the latent GP (the official code draws one :math:`z_0` per step; here the
    expectation is taken in closed form: the same quantity without the Monte Carlo noise):

    .. math::

        \mathcal L_{\mathrm{CGP}} &= -\mathbb E_{z_0 \sim \mathcal N(0, a^2 K_{00})}\big[\log \mathcal N(\mu \mid
            K_{q0} K_{00}^{-1} z_0, a^2 \Sigma_q) + \log \mathcal N(z_k \mid K_{k0} K_{00}^{-1} z_0, a^2 \Sigma_k)\big]
            \\
        &= \sum_{s \in \{q, k\}} \tfrac12 \sum_{c} \big[a^{-2} z_{s,c}^\top \Sigma_s^{-1} z_{s,c}
            + \mathrm{tr}(\Sigma_s^{-1} K_{s0} K_{00}^{-1} K_{0s}) + \log\lvert 2\pi a^2 \Sigma_s \rvert\big],

    with :math:`z_{q,c} = \mu_c`, :math:`z_{k,c} = K_{kk} v_c`, summed over the value dimensions :math:`c` and the
    heads. It is not a KL divergence (there is no variational posterior), so ``kl_divergence()`` is zero and the term is
    the added loss term ``"cgp_loss"`` (:class:`~gpattn.mlls.CGPAddedLossTerm`: :math:`\alpha` = ``cgp_weight`` times
    its mean over the sequences, as in the paper's :math:`\mathrm{CE} + \alpha \mathcal L_{\mathrm{CGP}}`), refreshed
    by every training ``forward`` when :math:`\alpha > 0` and cleared by any other call (an eval-mode loss has no such
    term; ``posterior()`` and the prediction helpers leave the training call's). It is **off by default**
    (:math:`\alpha = 0`): as the negative log-likelihood of the layer's own outputs under a covariance that the same
    parameters control, it is bounded below only by the nugget and is minimised by collapsing the queries (and keys)
    of a sequence onto one point (:math:`\log\lvert\Sigma_s\rvert \to N \log \epsilon`); on the comparison's
    tasks :math:`\alpha = 10^{-3}` already leaves the pointer task at chance and halves the digits accuracy (see the
    attention guide). The official code avoids the collapse with :math:`\lvert \log\lvert\Sigma\rvert \rvert` in
    place of :math:`\log\lvert\Sigma\rvert`, which is no longer a log-likelihood.

    **Numerics.** One jitter :math:`\epsilon` (``jitter``), a white-noise nugget of the model: :math:`\epsilon I` is
    added to :math:`K_{00}` and :math:`\epsilon \sigma_s^2 I` to :math:`K_{ss}` and :math:`\Sigma_s`, so that every
    formula above holds exactly for the jittered matrices. :math:`K_{00}`, :math:`K_{kk}`, :math:`\Sigma_q` and
    :math:`\Sigma_k` are factorised by Cholesky (never inverted); the squared distances are
    :func:`~gpattn.kernels.squared_distance`'s of tokens centred on the first real key :math:`t` of their sequence
    before the projections (:math:`W_q (x - t)`, ...; where queries or keys meet the latent inputs they are moved by
    :math:`(W_q - W_0) t` or :math:`(W_k - W_0) t`), so that a constant offset of the tokens costs no precision (the
    plain expansion of :math:`\lVert a - b \rVert^2` made :math:`K_{00}` indefinite at an offset of :math:`10^3` in
    float32). A failed factorisation, or a NaN or infinity in the results, raises a ``ValueError`` when the tokens
    exceed :func:`~gpattn.validation.token_magnitude_limit`; otherwise a failed factorisation raises
    :class:`~linear_operator.utils.errors.NotPSDError` naming the matrix (no retry with a larger jitter). The variance
    ratios are constrained to :math:`\sigma_q^2, \sigma_k^2 > 1`: :math:`\Sigma_q` is a Schur complement of the RBF
    Gram matrix on :math:`\{q\} \cup \{x_0\}` plus :math:`(\sigma_q^2 - 1)\kappa(q, q)`, so it is PSD for every input
    if and only if :math:`\sigma_q^2 \geq 1` (where :math:`q = x_0` it is :math:`(\sigma_q^2 - 1)\kappa(q, q)`).
    :math:`W_q, W_k, W_0` start at :math:`\mathcal N(0, 1 / (C p))`, so that unit-variance tokens give
    :math:`\mathbb E \lVert q_i - x_{0,j} \rVert^2 = 2` and kernel values around :math:`e^{-1}` rather than 0;
    :math:`\sigma_q^2 = \sigma_k^2 = 2` and :math:`a^2 = 0.1` at the start (with :math:`a^2 = 1` the initial sampling
    noise, of variance at least :math:`a^2 (\sigma_q^2 - 1)` per value dimension, swamps the mean: the comparison's
    pointer task then stays at chance).

    float16 and bfloat16 layers compute the projections :math:`W_q, W_k, W_0, W_v` and the GPs (kernel matrices,
    Cholesky factors, solves, samples and the regulariser) in float32: LAPACK has no half-precision Cholesky, and
    :math:`K_{00}^{-1}` amplifies the rounding of half-precision projections (a mean off by 100 % in float16). The
    heads' mean (or sample) and covariance are cast back to the tokens' dtype (``out_proj`` runs in it); the
    regulariser stays in float32.
    Under ``torch.autocast`` everything but ``out_proj`` runs in the parameters' precision (autocast off).

    **Masks.** Padded tokens leave the latent, key and (in self-attention) query sets: their rows and columns of the
    kernel matrices are decoupled, so the real tokens' outputs, samples (for the same noise) and objective are those
    of the real tokens alone. Causal masks are not supported: the CGP conditions all queries on one set of key
    observations and one latent set, whereas a causal mask gives query :math:`i` its own keys and latent inputs
    :math:`\le i`, i.e. :math:`N` different posteriors, with no joint predictive covariance to sample from and no
    single objective (the paper and its code have none). In cross-attention the keys, latent inputs and values come
    from ``context``.

    **Sparse variant.** The paper's sparse SCGPT is not implemented: its definition could not be read here beyond the
    abstract, and the official layer is not consistent enough to follow faithfully (its inducing inputs are a linear
    map over the token axis, fixed to one sequence length, which excludes padding and variable lengths; its mean uses
    :math:`(K_{mm} + \sigma^{-2} K_{m0} K_{0m})^{-1}` while its covariance and regulariser use
    :math:`(K_{mm} + \sigma^{-2} I)^{-1}`, and the regulariser has neither the quadratic nor the log-determinant term
    of the dense :math:`\mathcal L_{\mathrm{CGP}}`).

    :param embed_dim: Token width :math:`C`.
    :param num_heads: Number of heads :math:`H`.
    :param dropout: Dropout on the output.
    :param jitter: :math:`\epsilon \geq 0`, the nugget relative to each process's prior variance.
    :param cgp_weight: :math:`\alpha \geq 0`, the weight of the CGP regulariser (0: off, the default; see above).

    .. note:: Cost per head and sequence (:math:`N` queries, :math:`M` keys, head width :math:`p`): O((N + M) M p)
        for the kernel matrices, O(M^3) for the Cholesky factor of :math:`K_{00}` and O(M^2 (N + M)) for the
        triangular solves of the mean; :meth:`posterior` adds the factor of :math:`K_{kk}` and O(M^2 N). A training
        step (sample and regulariser) adds the factors of :math:`\Sigma_q` (O(N^3)) and :math:`\Sigma_k`
        (O(M^3)) and O(N^2 M + M^3) solves: cubic in the sequence length, O(N^2) memory per head.

    Example:
        >>> layer = CGPTAttention(embed_dim=32, num_heads=4)
        >>> x = torch.randn(2, 10, 32)
        >>> sample = layer(x)  # training mode: a joint sample across the tokens
        >>> mean, variance = layer.eval().posterior(x)  # each (2, 10, 32)
    """

    is_stochastic = True
    supports_causal = False

    def __init__(
        self, embed_dim: int, num_heads: int, dropout: float = 0.0, jitter: float = 1e-5, cgp_weight: float = 0.0
    ):
        super().__init__(embed_dim, num_heads, dropout)
        where = type(self).__name__
        self.jitter = check_float("jitter", jitter, 0.0, 1.0, strict_maximum=True, where=where)
        self.cgp_weight = check_float("cgp_weight", cgp_weight, 0.0, where=where)
        self.query_proj = torch.nn.Linear(embed_dim, embed_dim, bias=False)
        self.key_proj = torch.nn.Linear(embed_dim, embed_dim, bias=False)
        self.latent_proj = torch.nn.Linear(embed_dim, embed_dim, bias=False)  # W_0
        self.value_proj = torch.nn.Linear(embed_dim, embed_dim, bias=False)
        for projection in (self.query_proj, self.key_proj, self.latent_proj):
            torch.nn.init.normal_(projection.weight, std=(embed_dim * self.head_dim) ** -0.5)
        for name, constraint in SCALES.items():
            self.register_parameter(f"raw_{name}", torch.nn.Parameter(torch.zeros(num_heads)))
            self.register_constraint(f"raw_{name}", constraint())
        self.initialize(outputscale=0.1, query_variance_ratio=2.0, key_variance_ratio=2.0)
        self.register_added_loss_term("cgp_loss")

    # -- parameters --------------------------------------------------------------------------------------------------
    def _scale(self, name: str) -> Tensor:
        return getattr(self, f"raw_{name}_constraint").transform(getattr(self, f"raw_{name}"))

    def _set_scale(self, name: str, value: Tensor | float) -> None:
        constraint, where = getattr(self, f"raw_{name}_constraint"), type(self).__name__
        checked = check_positive(name, value, getattr(self, f"raw_{name}"), where=where)
        if not bool((checked > constraint.lower_bound).all()):
            raise ValueError(
                f"{where}: expected {name} > 1 (below 1 the conditional covariance given the latent GP is not PSD for "
                f"every input), got {checked.tolist()}"
            )
        initialize_positive(self, f"raw_{name}", name, value, where)  # a value that fits the (H,) shape, or an error

    @property
    def outputscale(self) -> Tensor:
        """:math:`a^2 > 0`, the amplitude of the three GPs (the latent GP's prior variance), shape ``(H,)``."""
        return self._scale("outputscale")

    @outputscale.setter
    def outputscale(self, value: Tensor | float) -> None:
        self._set_scale("outputscale", value)

    @property
    def query_variance_ratio(self) -> Tensor:
        r""":math:`\sigma_q^2 > 1`, the query GP's prior variance relative to the latent GP's, shape ``(H,)``."""
        return self._scale("query_variance_ratio")

    @query_variance_ratio.setter
    def query_variance_ratio(self, value: Tensor | float) -> None:
        self._set_scale("query_variance_ratio", value)

    @property
    def key_variance_ratio(self) -> Tensor:
        r""":math:`\sigma_k^2 > 1`, the key GP's prior variance relative to the latent GP's, shape ``(H,)``."""
        return self._scale("key_variance_ratio")

    @key_variance_ratio.setter
    def key_variance_ratio(self, value: Tensor | float) -> None:
        self._set_scale("key_variance_ratio", value)

    # -- the correlated GPs ------------------------------------------------------------------------------------------
    def _cholesky(self, covar: Tensor, variance: Tensor | float, name: str, tokens: tuple[Tensor, Tensor]) -> Tensor:
        """The Cholesky factor of ``covar + jitter * variance * I`` (``(B, H, n, n)``); raises on failure: a
        ``ValueError`` when the input ``tokens`` are too large for their dtype, else a ``NotPSDError``."""
        eye = torch.eye(covar.shape[-1], dtype=covar.dtype, device=covar.device)
        factor, info = torch.linalg.cholesky_ex(covar + self.jitter * variance * eye)
        failed = info > 0
        if bool(failed.any()):
            check_overflow((covar,), tokens, GROWTH, where=type(self).__name__)
            raise NotPSDError(
                f"{type(self).__name__}: the Cholesky factorisation of {name} failed for {int(failed.sum())} of "
                f"{failed.numel()} (sequence, head) pairs: not positive definite at jitter={self.jitter:g} in "
                f"{covar.dtype} (tokens too close to one another for this nugget). Raise `jitter` or compute in "
                "float64."
            )
        return factor

    def _latent(self, inputs: AttentionInputs) -> _Latent:
        # the kernels are translation invariant: centre the tokens on one of them before projecting, and move the
        # queries and keys by (W_q - W_0) t and (W_k - W_0) t where they meet the latent inputs
        tokens = (inputs.queries, inputs.keys)
        # float32 at least from the projections on (LAPACK has no half-precision Cholesky, and K_00^{-1} amplifies
        # the rounding of half-precision projections); the caller casts the results back
        dtype = torch.promote_types(inputs.keys.dtype, torch.float32)
        # padding set to the first real token t, the origin: it cannot move the centring of the squared distances (a
        # mean over the points: large padding cost the real tokens all their digits, or made K_00 not PSD)
        key_tokens, origin = padding_filled(inputs.keys.to(dtype), inputs.key_mask)  # t; shape: (B, 1, C)
        query_tokens = inputs.queries.to(dtype) if inputs.is_cross else key_tokens

        query_weight, key_weight, latent_weight, value_weight = (
            projection.weight.to(dtype)
            for projection in (self.query_proj, self.key_proj, self.latent_proj, self.value_proj)
        )

        def project(source: Tensor, weight: Tensor) -> Tensor:  # (B, n, C) -> (B, H, n, p)
            return self.split_heads(torch.nn.functional.linear(source, weight))

        queries = project(query_tokens - origin, query_weight)  # W_q (x - t); shape: (B, H, N, p)
        keys = project(key_tokens - origin, key_weight)  # shape: (B, H, M, p)
        latents = project(key_tokens - origin, latent_weight)  # x_0 - W_0 t; shape: (B, H, M, p)
        values = project(key_tokens, value_weight)
        key_mask = None if inputs.key_mask is None else inputs.key_mask.unsqueeze(1)  # shape: (B, 1, M)
        query_mask = None if inputs.is_cross else key_mask
        if key_mask is not None:  # z_k = K_kk v must vanish at padded keys
            values = values * key_mask.unsqueeze(-1)
        # the matrices K of the unit-amplitude GPs; the GPs' covariances are a^2 K
        latent_covar = _decouple(_rbf(latents), key_mask, 1.0)  # K_00; shape: (B, H, M, M)
        latent_chol = self._cholesky(latent_covar, 1.0, "K_00 (the latent GP's kernel matrix on x_0)", tokens)
        # kappa(W_0 x_j, W_q x_i) = kappa(x_0 - W_0 t, q + (W_q - W_0) t), likewise for the keys; the difference of
        # the weights first, so that nearly equal projections of a distant t do not cancel
        query_shift = project(origin, query_weight - latent_weight)  # shape: (B, H, 1, p)
        key_shift = project(origin, key_weight - latent_weight)
        latent_query = _restrict(_rbf(latents, queries + query_shift), key_mask, query_mask)  # K_0q; (B, H, M, N)
        latent_key = _restrict(_rbf(latents, keys + key_shift), key_mask, key_mask)  # K_0k; shape: (B, H, M, M)
        query_interp = torch.linalg.solve_triangular(latent_chol, latent_query, upper=False)
        key_interp = torch.linalg.solve_triangular(latent_chol, latent_key, upper=False)
        amplitude = self.outputscale.to(dtype)[:, None, None]  # a^2; shape: (H, 1, 1)
        mean = query_interp.mT @ (key_interp @ values)  # K_qk v = K_q0 K_00^{-1} K_0k v, free of a^2
        return _Latent(tokens, queries, keys, values, query_mask, key_mask, query_interp, key_interp, amplitude, mean)

    def _prior_covar(self, side: str, latent: _Latent) -> tuple[Tensor, Tensor]:
        r""":math:`K_{ss} = \sigma_s^2 \kappa(s, s)` (padded tokens decoupled, no nugget), ``(B, H, n, n)``, and
        :math:`\sigma_s^2`, shape ``(H, 1, 1)``."""
        tokens, mask = (latent.queries, latent.query_mask) if side == "query" else (latent.keys, latent.key_mask)
        ratio = getattr(self, f"{side}_variance_ratio").to(tokens.dtype)[:, None, None]
        return _decouple(ratio * _rbf(tokens), mask, ratio), ratio

    def _conditional_cholesky(self, side: str, latent: _Latent, prior_covar: Tensor, ratio: Tensor) -> Tensor:
        r"""The Cholesky factor :math:`L_s` of :math:`\Sigma_s = K_{ss} - K_{s0} K_{00}^{-1} K_{0s}` (+ nugget)."""
        interp = latent.query_interp if side == "query" else latent.key_interp
        conditional = prior_covar - interp.mT @ interp
        name = f"Sigma_{side[0]} (the {side} GP's covariance given z_0)"
        return self._cholesky(conditional, ratio, name, latent.tokens)

    def _objective(self, latent: _Latent, side: str, observed: Tensor, chol: Tensor) -> Tensor:
        r""":math:`\tfrac12 \sum_c [a^{-2} z_c^\top \Sigma_s^{-1} z_c + \mathrm{tr}(\Sigma_s^{-1} K_{s0} K_{00}^{-1}
        K_{0s}) + \log|2\pi a^2 \Sigma_s|]` for one side, shape ``(B, H)``; ``chol`` is :math:`L_s`."""
        interp, mask = (
            (latent.query_interp, latent.query_mask) if side == "query" else (latent.key_interp, latent.key_mask)
        )
        amplitude = latent.amplitude.squeeze(-1)  # shape: (H, 1)
        quad = torch.linalg.solve_triangular(chol, observed, upper=False).square().sum((-2, -1)) / amplitude[:, 0]
        trace = torch.linalg.solve_triangular(chol, interp.mT, upper=False).square().sum((-2, -1))  # tr(Sigma^-1 Q)
        log_diag = (chol.diagonal(dim1=-2, dim2=-1).square() * (2 * math.pi) * amplitude).log()  # log(2 pi Sigma_ii)
        if mask is not None:
            log_diag = log_diag * mask  # padded tokens are left out of log|2 pi Sigma|
        return 0.5 * (quad + observed.shape[-1] * (trace + log_diag.sum(-1)))

    def _sample_and_objective(self, latent: _Latent, objective: bool) -> tuple[Tensor, Tensor | None]:
        """A joint sample of every head ``(B, H, N, p)`` by Matheron's rule and (``objective``) the regulariser per
        sequence, summed over heads, shape ``(B,)``."""
        query_covar, query_ratio = self._prior_covar("query", latent)
        key_covar, key_ratio = self._prior_covar("key", latent)
        query_chol = self._conditional_cholesky("query", latent, query_covar, query_ratio)
        key_cond_chol = self._conditional_cholesky("key", latent, key_covar, key_ratio)
        key_chol = self._cholesky(key_covar, key_ratio, "K_kk (the key GP's kernel matrix)", latent.tokens)
        # unit-amplitude prior draws: z_0' = L_00 eps_0, so that K_s0 K_00^{-1} z_0' = interp_s^T eps_0
        latent_noise = torch.randn_like(latent.values)
        prior_key = latent.key_interp.mT @ latent_noise + key_cond_chol @ torch.randn_like(latent.values)
        weights = torch.cholesky_solve(prior_key, key_chol)  # K_kk^{-1} z_k'
        # z_q' - K_qk K_kk^{-1} z_k' with z_q' = interp_q^T eps_0 + L_q eps_q and K_qk = interp_q^T interp_k
        noise = latent.query_interp.mT @ (latent_noise - latent.key_interp @ weights)
        noise = noise + query_chol @ torch.randn_like(latent.mean)
        sample = latent.mean + latent.amplitude.sqrt() * noise  # every prior draw scales with a
        if not objective:
            return sample, None
        observed_keys = key_covar @ latent.values + self.jitter * key_ratio * latent.values  # z_k = K_kk v
        loss = self._objective(latent, "query", latent.mean, query_chol)
        loss = loss + self._objective(latent, "key", observed_keys, key_cond_chol)
        return sample, loss.sum(-1)

    # -- attention interface -----------------------------------------------------------------------------------------
    def forward(self, x: Tensor, mask: Tensor | str | None = None, context: Tensor | None = None) -> Tensor:
        inputs = self._prepare(x, mask, context)
        loss = None
        with torch.autocast(x.device.type, enabled=False):  # Cholesky factors in float32 at least
            latent = self._latent(inputs)
            heads = latent.mean
            if self.sampling:
                with_objective = self.training and self.cgp_weight > 0
                heads, loss = self._sample_and_objective(latent, objective=with_objective)
        heads = heads.to(x.dtype)
        check_overflow((heads, loss), latent.tokens, GROWTH, where=type(self).__name__)
        if loss is not None:
            self.update_added_loss_term("cgp_loss", CGPAddedLossTerm(loss, self.cgp_weight))
        else:  # no objective in this call (eval mode, no sampling, weight 0): no term, not the last training call's
            self._added_loss_terms["cgp_loss"] = None
        return self.project_out(heads)

    def head_covariance(
        self, x: Tensor, mask: Tensor | str | None = None, context: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Predictive mean ``(B, H, N, C / H)`` of every head and its covariance across the tokens
        :math:`a^2 (K_{qq} - K_{qk} K_{kk}^{-1} K_{kq})`, ``(B, H, N, N)``, shared by the value dimensions (which are
        independent). Padded queries are decoupled from the real ones."""
        inputs = self._prepare(x, mask, context)
        with torch.autocast(x.device.type, enabled=False):
            latent = self._latent(inputs)
            key_covar, key_ratio = self._prior_covar("key", latent)
            key_chol = self._cholesky(key_covar, key_ratio, "K_kk (the key GP's kernel matrix)", latent.tokens)
            key_query_covar = latent.key_interp.mT @ latent.query_interp  # K_kq; shape: (B, H, M, N)
            explained = torch.linalg.solve_triangular(key_chol, key_query_covar, upper=False)  # L_kk^{-1} K_kq
            query_covar, query_ratio = self._prior_covar("query", latent)
            eye = torch.eye(query_covar.shape[-1], dtype=query_covar.dtype, device=query_covar.device)
            covar = latent.amplitude * (query_covar + self.jitter * query_ratio * eye - explained.mT @ explained)
        mean, covar = latent.mean.to(x.dtype), covar.to(x.dtype)
        check_overflow((mean, covar), latent.tokens, GROWTH, where=type(self).__name__)
        return mean, covar

    def head_moments(
        self, x: Tensor, mask: Tensor | str | None = None, context: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Predictive mean and variance of every head before the output projection, each ``(B, H, N, C / H)``: the
        diagonal of :meth:`head_covariance`, the same for all value dimensions."""
        mean, covar = self.head_covariance(x, mask, context)
        variance = covar.diagonal(dim1=-2, dim2=-1).clamp_min(0)  # clamped against rounding; shape: (B, H, N)
        return mean, variance.unsqueeze(-1).expand_as(mean)

    def posterior(
        self, x: Tensor, mask: Tensor | str | None = None, context: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Mean and variance of the output after ``out_proj`` (no dropout), each ``(B, N, C)``."""
        return self.project_out_moments(*self.head_moments(x, mask, context))
