"""Symmetric SVGP attention: a standard GPyTorch SVGP per head on context-augmented token features (a baseline)."""

from __future__ import annotations

import math

import torch
from gpytorch.distributions import MultivariateNormal
from gpytorch.kernels import RBFKernel, ScaleKernel
from gpytorch.means import ZeroMean
from gpytorch.models import ApproximateGP
from gpytorch.variational import CholeskyVariationalDistribution, VariationalStrategy
from torch import Tensor

from ..validation import InputTypeError, check_int, check_overflow
from ._base import AttentionInputs, AttentionLayer

#: what overflows at large tokens, for the message of the magnitude guard
GROWTH = "the GP inputs grow like |x| and the squared distances of its RBF kernel like |x|^2"


class _VariationalStrategy(VariationalStrategy):
    """GPyTorch's :class:`~gpytorch.variational.VariationalStrategy`, loadable from a state dict that holds none of its
    keys (e.g. a softmax layer's, ``strict=False`` when warm-starting): GPyTorch's load pre-hook reads the first key
    of the strategy's share of the state dict and raised ``IndexError`` on an empty one, before torch could name the
    missing keys."""

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        if not any(key.startswith(prefix) for key in state_dict):  # the flag GPyTorch's hook looks for, as it is now
            state_dict = {**state_dict, prefix + "updated_strategy": self.updated_strategy.detach().clone()}
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class _HeadwiseSVGP(ApproximateGP):
    """``H x p`` independent whitened SVGPs: batch shape ``(H, p)`` for :math:`q(u)`; per head one set of ``M``
    inducing points ``(H, 1, M, p)`` and one ``ScaleKernel(RBFKernel(ard_num_dims=p))`` shared by the ``p`` outputs."""

    def __init__(self, num_heads: int, head_dim: int, num_inducing: int):
        variational_distribution = CholeskyVariationalDistribution(
            num_inducing, batch_shape=torch.Size([num_heads, head_dim])
        )
        inducing_points = torch.randn(num_heads, 1, num_inducing, head_dim)
        strategy = _VariationalStrategy(self, inducing_points, variational_distribution, learn_inducing_locations=True)
        super().__init__(strategy)
        kernel_batch = torch.Size([num_heads, 1])
        self.mean_module = ZeroMean()
        self.covar_module = ScaleKernel(
            RBFKernel(ard_num_dims=head_dim, batch_shape=kernel_batch), batch_shape=kernel_batch
        )
        self.covar_module.base_kernel.lengthscale = math.sqrt(head_dim)  # ||x - y||^2 ~ 2p for unit-scale features
        # initialise q(u) now rather than on the first call, which would overwrite any value set before it
        variational_distribution.initialize_variational_distribution(strategy.prior_distribution)
        strategy.variational_params_initialized.fill_(1)
        strategy._clear_cache()

    def forward(self, x: Tensor) -> MultivariateNormal:
        return MultivariateNormal(self.mean_module(x), self.covar_module(x))


class SymmetricSVGPAttention(AttentionLayer):
    r"""Symmetric SVGP attention: a per-token GP on context-augmented token features (the "symmetric SVGP" baseline
    of docs/math.md section 5).

    Per head :math:`h` the GP input of query token :math:`i` is its projected query plus the mean of the projected
    keys it may see (the context summary),

    .. math::

        z_i = W_q^{(h)} x_i + \frac{1}{|V_i|} \sum_{j \in V_i} W_k^{(h)} x_j,

    with :math:`V_i` the real keys (padding mask), the prefix :math:`j \le i` (causal) or all ``context`` tokens
    (cross-attention). Each of the :math:`p = C / H` output dimensions of a head is an independent whitened SVGP
    (GPyTorch :class:`~gpytorch.variational.VariationalStrategy`,
    :class:`~gpytorch.variational.CholeskyVariationalDistribution`, zero mean) over :math:`z` with ``num_inducing``
    learned inducing points and a stationary ``ScaleKernel(RBFKernel(ard_num_dims=p))``, both shared by the outputs
    of a head. Tokens interact only through the context summary: the GP is symmetric and stationary in the token
    features, not a kernel between queries and keys, which makes this a fair symmetric-SVGP ablation of the
    kernel-attention layers.

    The output of a head is a reparameterised sample from the marginals of :math:`q(f(z_i))`,
    :math:`\mu_i + \sigma_i \varepsilon_i` (training, or :func:`~gpattn.attention._base.sample_attention`), or the mean
    :math:`\mu_i` (eval); heads are concatenated and projected. :meth:`kl_divergence` is
    :math:`\sum_{h, d} \mathrm{KL}(q(u_{hd}) \| \mathcal N(0, I))` and does not depend on the data.

    Numerics: GPyTorch's ``RBFKernel`` centres its squared distances, so they do not lose precision at an offset of
    the GP inputs; a NaN or an infinity in the moments raises a ``ValueError`` when the tokens exceed
    :func:`~gpattn.validation.token_magnitude_limit`. GPyTorch's variational strategy has no float16 or bfloat16
    jitter (nor LAPACK a half-precision Cholesky): a half-precision layer raises a ``TypeError`` saying so; keep it in
    float32 and use ``torch.autocast``, under which the GP computes in float32.

    :param embed_dim: Token width :math:`C`.
    :param num_heads: Number of heads :math:`H`.
    :param num_inducing: :math:`M`, inducing points per head.
    :param dropout: Dropout on the output.

    .. note:: Cost: O(N C^2) for the projections, O(N p) for the context summaries, then per head and output
        dimension O(N M^2 + M^3) (the Cholesky of :math:`K_{uu}` is shared by the outputs of a head). The GP sees the
        ``B N`` tokens of a batch as one data set: only marginals are used, so the sequences stay independent.
        Nothing is cached between calls (GPyTorch's eval-mode memo of the :math:`K_{uu}` Cholesky is cleared before
        and after each call), so the output always follows the current parameters and every call has its own graph.
    """

    is_stochastic = True

    def __init__(self, embed_dim: int, num_heads: int, num_inducing: int = 16, dropout: float = 0.0):
        super().__init__(embed_dim, num_heads, dropout)
        self.num_inducing = check_int("num_inducing", num_inducing, where=type(self).__name__)
        self.query_proj = torch.nn.Linear(embed_dim, embed_dim, bias=False)
        self.key_proj = torch.nn.Linear(embed_dim, embed_dim, bias=False)
        # the checked Python ints: GPyTorch's kernels fail on a NumPy integer in their batch shape
        self.gp = _HeadwiseSVGP(self.num_heads, self.head_dim, self.num_inducing)

    def gp_inputs(self, x: Tensor, mask: Tensor | str | None = None, context: Tensor | None = None) -> Tensor:
        """The GP inputs :math:`z_i` = projected query + context summary, shape ``(B, H, N, C / H)``."""
        return self._gp_inputs(self._prepare(x, mask, context))

    def _gp_inputs(self, inputs: AttentionInputs) -> Tensor:
        queries = self.split_heads(self.query_proj(inputs.queries))  # shape: (B, H, N, p)
        keys = self.split_heads(self.key_proj(inputs.keys))  # shape: (B, H, M, p)
        if inputs.causal:  # prefix means
            counts = torch.arange(1, keys.shape[-2] + 1, dtype=keys.dtype, device=keys.device)
            summary = keys.cumsum(-2) / counts.unsqueeze(-1)
        elif inputs.key_mask is not None:  # mean over the real keys
            weights = inputs.key_mask[:, None, :, None].to(keys.dtype)  # shape: (B, 1, M, 1)
            summary = (keys * weights).sum(-2, keepdim=True) / weights.sum(-2, keepdim=True)
        else:
            summary = keys.mean(-2, keepdim=True)
        return queries + summary

    def _moments(self, inputs: AttentionInputs) -> tuple[Tensor, Tensor]:
        """Marginal mean and variance of every head's GP at the tokens, each ``(B, H, N, p)``."""
        features = self._gp_inputs(inputs)
        batch, heads, length, width = features.shape
        # the B N tokens as one data set per head: (H, 1, B N, p), broadcast against the (H, p) batch of q(u)
        flat = features.transpose(0, 1).reshape(heads, 1, batch * length, width)
        # the GP (a K_uu Cholesky, triangular solves) runs in the parameters' precision, never autocast's: GPyTorch's
        # custom backward of the predictive updates fails on the mixed dtypes that autocast would produce
        strategy = self.gp.variational_strategy
        if strategy.inducing_points.dtype in (torch.float16, torch.bfloat16):
            raise InputTypeError(
                f"{type(self).__name__}: GPyTorch's variational strategy (its Cholesky factor of K_uu and its jitter) "
                f"needs float32 or float64 parameters, got {strategy.inducing_points.dtype}: keep this layer in "
                "float32 (layer.float()) and use torch.autocast for mixed precision, under which it computes in float32"
            )
        # no memo survives a call: GPyTorch memoises the K_uu Cholesky in eval mode, which would go stale after an
        # in-place parameter update and hold this call's autograd graph (a second backward would fail); the
        # recomputation is O(H M^3), small against the O(B N M^2) of the predictions
        strategy._clear_cache()
        try:
            with torch.autocast(flat.device.type, enabled=False):
                posterior = self.gp(flat.to(strategy.inducing_points.dtype))  # batch (H, p), event B N
                mean, variance = posterior.mean, posterior.variance
        finally:
            strategy._clear_cache()

        def unflatten(tokens: Tensor) -> Tensor:  # (H, p, B N) -> (B, H, N, p)
            return tokens.reshape(heads, width, batch, length).permute(2, 0, 3, 1)

        mean, variance = unflatten(mean).to(inputs.queries.dtype), unflatten(variance).to(inputs.queries.dtype)
        check_overflow((mean, variance), (inputs.queries, inputs.keys), GROWTH, where=type(self).__name__)
        return mean, variance

    # -- attention interface -----------------------------------------------------------------------------------------
    def forward(self, x: Tensor, mask: Tensor | str | None = None, context: Tensor | None = None) -> Tensor:
        mean, variance = self._moments(self._prepare(x, mask, context))
        if self.sampling:  # marginal reparameterisation: O(N M^2), no N x N covariance
            mean = mean + variance.sqrt() * torch.randn_like(mean)
        return self.project_out(mean)

    def head_moments(
        self, x: Tensor, mask: Tensor | str | None = None, context: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Predictive mean and variance of every head before the output projection, each ``(B, H, N, C / H)``."""
        return self._moments(self._prepare(x, mask, context))

    def posterior(
        self, x: Tensor, mask: Tensor | str | None = None, context: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Mean and variance of the output after ``out_proj`` (no dropout), each ``(B, N, C)``."""
        return self.project_out_moments(*self.head_moments(x, mask, context))

    def kl_divergence(self) -> Tensor:
        """:math:`\\sum_{h, d} \\mathrm{KL}(q(u_{hd}) \\| p(u_{hd}))` (whitened prior :math:`\\mathcal N(0, I)`),
        a scalar."""
        return self.gp.variational_strategy.kl_divergence().sum()

    def _apply(self, fn, *args, **kwargs):
        # GPyTorch memoises the K_uu Cholesky in eval mode: a dtype or device change must not reuse the old one
        self.gp.variational_strategy._clear_cache()
        return super()._apply(fn, *args, **kwargs)

    def __getstate__(self) -> dict:
        # the eval-mode caches may hang on an autograd graph, which neither deepcopy nor pickle accept (the base
        # detaches the results of the last call)
        self.gp.variational_strategy._clear_cache()
        return super().__getstate__()
