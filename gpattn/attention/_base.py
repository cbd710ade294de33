"""The interface shared by every attention layer: input checks, masks, heads, output projection, sampling mode."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from gpytorch.module import Module
from torch import Tensor


@dataclass(frozen=True)
class AttentionInputs:
    """Checked inputs of one attention call.

    :ivar queries: shape ``(B, N, C)``.
    :ivar keys: shape ``(B, M, C)`` (the queries in self-attention, ``context`` in cross-attention).
    :ivar key_mask: ``None`` or a boolean ``(B, M)`` tensor, ``True`` for real tokens, ``False`` for padding.
    :ivar causal: Query ``i`` may only see keys ``j <= i`` (self-attention only).
    :ivar is_cross: ``context`` was given.
    """

    queries: Tensor
    keys: Tensor
    key_mask: Tensor | None
    causal: bool
    is_cross: bool


class AttentionLayer(Module):
    r"""Base class of the attention layers: one signature for all.

    ``forward(x, mask=None, context=None)`` maps tokens ``x`` of shape ``(B, N, C)`` to ``(B, N, C)``:

    * ``mask``: ``None``; a boolean padding mask of shape ``(B, M)`` with ``True`` for real tokens (masked keys have
      no influence on any output; outputs at padded query positions are unspecified and must be ignored
      downstream); or the string ``"causal"`` (output ``i`` depends on tokens ``<= i`` only).
    * ``context``: key tokens of shape ``(B, M, C)`` for cross-attention (``M`` may differ from ``N``).

    Stochastic layers return a reparameterised sample in training mode and the predictive mean in eval mode,
    unless sampling is switched on with :func:`sample_attention`. They expose ``kl_divergence()`` (zero for
    deterministic layers) and ``posterior(x, ...)`` (predictive mean and variance of the output).

    :param embed_dim: Token width :math:`C`.
    :param num_heads: Number of heads :math:`H` (must divide ``embed_dim``).
    :param dropout: Dropout on the output.
    """

    is_stochastic: bool = False
    supports_cross_attention: bool = True
    supports_causal: bool = True

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0):
        super().__init__()
        for name, value in (("embed_dim", embed_dim), ("num_heads", num_heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"expected a positive integer {name}, got {value!r}")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"expected dropout in [0, 1), got {dropout}")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.out_proj = torch.nn.Linear(embed_dim, embed_dim)
        self.dropout = torch.nn.Dropout(dropout)
        self.sample_in_eval = False

    # -- inputs ------------------------------------------------------------------------------------------------------
    def _check_tokens(self, tokens: Tensor, name: str) -> None:
        if not isinstance(tokens, Tensor):
            raise TypeError(f"expected {name} to be a torch.Tensor, got {type(tokens).__name__}")
        if not tokens.is_floating_point():
            raise TypeError(f"expected {name} to be a floating-point tensor, got {tokens.dtype}")
        if tokens.dim() != 3 or tokens.shape[-1] != self.embed_dim:
            raise ValueError(f"expected {name} of shape (B, N, {self.embed_dim}), got {tuple(tokens.shape)}")
        if tokens.shape[0] == 0 or tokens.shape[1] == 0:
            raise ValueError(f"expected a non-empty batch of non-empty sequences for {name}, got {tuple(tokens.shape)}")
        if not torch.isfinite(tokens).all():
            raise ValueError(f"{name} contains NaN or Inf")

    def _prepare(self, x: Tensor, mask: Tensor | str | None, context: Tensor | None) -> AttentionInputs:
        self._check_tokens(x, "x")
        keys = x
        if context is not None:
            if not self.supports_cross_attention:
                raise ValueError(f"{type(self).__name__} does not support cross-attention (context=...)")
            self._check_tokens(context, "context")
            if context.shape[0] != x.shape[0] or context.dtype != x.dtype or context.device != x.device:
                raise ValueError(
                    f"context must match x in batch size, dtype and device: got {tuple(context.shape)} "
                    f"{context.dtype} {context.device} for x {tuple(x.shape)} {x.dtype} {x.device}"
                )
            keys = context
        causal, key_mask = False, None
        if isinstance(mask, str):
            if mask != "causal":
                raise ValueError(f"expected mask to be None, a boolean tensor or 'causal', got {mask!r}")
            if not self.supports_causal:
                raise ValueError(f"{type(self).__name__} does not support causal masks")
            if context is not None:
                raise ValueError("a causal mask needs self-attention (context=None)")
            causal = True
        elif mask is not None:
            if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
                got = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
                raise TypeError(f"expected a boolean padding mask (True = real token), got {got}")
            expected = (keys.shape[0], keys.shape[1])
            if tuple(mask.shape) != expected:
                raise ValueError(f"expected a padding mask of shape {expected}, got {tuple(mask.shape)}")
            if mask.device != keys.device:
                raise ValueError(f"mask is on {mask.device} but the tokens are on {keys.device}")
            empty = ~mask.any(dim=-1)
            if empty.any():
                raise ValueError(f"the mask hides every token of sequence(s) {empty.nonzero().flatten().tolist()}")
            key_mask = mask
        return AttentionInputs(x, keys, key_mask, causal, context is not None)

    # -- heads -------------------------------------------------------------------------------------------------------
    def split_heads(self, tokens: Tensor) -> Tensor:
        """``(B, N, C)`` -> ``(B, H, N, C / H)``."""
        batch, length, _ = tokens.shape
        return tokens.view(batch, length, self.num_heads, -1).transpose(1, 2)

    @staticmethod
    def merge_heads(tokens: Tensor) -> Tensor:
        """``(B, H, N, d)`` -> ``(B, N, H d)``."""
        batch, heads, length, width = tokens.shape
        return tokens.transpose(1, 2).reshape(batch, length, heads * width)

    def project_out(self, heads: Tensor) -> Tensor:
        """Concatenate heads ``(B, H, N, C / H)`` and apply the output projection and dropout: ``(B, N, C)``."""
        return self.dropout(self.out_proj(self.merge_heads(heads)))

    def project_out_moments(self, mean_heads: Tensor, variance_heads: Tensor) -> tuple[Tensor, Tensor]:
        r"""Push per-head marginal moments through the output projection (no dropout).

        With independent head outputs :math:`h` (variances :math:`\sigma^2`) and ``out_proj`` :math:`y = W h + b`,
        the output has mean :math:`W \mu + b` and variance :math:`(W \odot W) \sigma^2`.

        :param mean_heads: shape ``(B, H, N, C / H)``.
        :param variance_heads: shape ``(B, H, N, C / H)``, independent entries.
        :return: Mean and variance, each of shape ``(B, N, C)``.
        """
        mean = self.out_proj(self.merge_heads(mean_heads))
        variance = self.merge_heads(variance_heads) @ self.out_proj.weight.square().mT
        return mean, variance

    # -- probabilistic interface -------------------------------------------------------------------------------------
    @property
    def sampling(self) -> bool:
        """Whether ``forward`` returns a sample (training, or eval inside :func:`sample_attention`)."""
        return self.is_stochastic and (self.training or self.sample_in_eval)

    def kl_divergence(self) -> Tensor:
        """Sum of the KL terms of the layer (zero for deterministic layers), a scalar."""
        parameter = next(self.parameters())
        return torch.zeros((), dtype=parameter.dtype, device=parameter.device)

    def posterior(
        self, x: Tensor, mask: Tensor | str | None = None, context: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Predictive mean and variance of the output, each ``(B, N, C)``; deterministic layers have zero variance."""
        mean = self.predictive_mean(x, mask, context)
        return mean, torch.zeros_like(mean)

    def predictive_mean(self, x: Tensor, mask: Tensor | str | None = None, context: Tensor | None = None) -> Tensor:
        """The output with sampling switched off (and dropout as the current mode has it)."""
        previous_training, previous_sample = self.training, self.sample_in_eval
        self.sample_in_eval = False
        try:
            if self.is_stochastic:
                self.train(False)
            return self(x, mask=mask, context=context)
        finally:
            self.train(previous_training)
            self.sample_in_eval = previous_sample

    def forward(self, x: Tensor, mask: Tensor | str | None = None, context: Tensor | None = None) -> Tensor:
        raise NotImplementedError


@contextmanager
def sample_attention(module: torch.nn.Module, enabled: bool = True):
    """Within the block, every stochastic :class:`AttentionLayer` in ``module`` returns samples in eval mode too
    (Monte Carlo prediction); restores the previous setting afterwards."""
    layers = [layer for layer in module.modules() if isinstance(layer, AttentionLayer)]
    previous = [layer.sample_in_eval for layer in layers]
    for layer in layers:
        layer.sample_in_eval = enabled
    try:
        yield module
    finally:
        for layer, value in zip(layers, previous, strict=True):
            layer.sample_in_eval = value
