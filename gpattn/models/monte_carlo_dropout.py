r"""Monte Carlo dropout (Gal & Ghahramani, ICML 2016): dropout kept on at test time, averaged over samples.

With dropout rate :math:`q`, every forward pass in training mode draws fresh Bernoulli masks, so :math:`T` passes give
logit samples :math:`f^{(t)}(x)` of an approximate posterior predictive, and
:math:`\frac1T \sum_t \operatorname{softmax}(f^{(t)}(x))` is the MC-dropout prediction. :func:`mc_dropout` switches
the dropout modules of a model into training mode, leaving every other module (LayerNorm, the attention layers'
own sampling switch, batch norms) as it is, so that a model in eval mode samples dropout masks and nothing else.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch

from .._torch_compat import mha_fastpath_disabled
from ..validation import check_bool

__all__ = ["DROPOUT_MODULES", "dropout_modules", "mc_dropout"]

#: The torch modules that :func:`mc_dropout` switches on.
DROPOUT_MODULES: tuple[type[torch.nn.Module], ...] = (
    torch.nn.Dropout,
    torch.nn.Dropout1d,
    torch.nn.Dropout2d,
    torch.nn.Dropout3d,
    torch.nn.AlphaDropout,
    torch.nn.FeatureAlphaDropout,
)


def dropout_modules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The dropout modules of ``module`` (itself included) with a rate :math:`q > 0`, in ``modules()`` order."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"dropout_modules: expected a torch.nn.Module, got {type(module).__name__}")
    return [layer for layer in module.modules() if isinstance(layer, DROPOUT_MODULES) and layer.p > 0]


@contextmanager
def mc_dropout(module: torch.nn.Module, enabled: bool = True) -> Iterator[torch.nn.Module]:
    """Within the block, every dropout module of ``module`` with a rate :math:`q > 0` is in training mode (draws masks)
    whatever the mode of the rest of the model; their previous modes are restored afterwards, also on an exception.

    Enter it *after* ``model.eval()``: a later ``model.eval()`` or ``model.train(False)`` inside the block switches
    dropout off again. The masks come from the global torch RNG, so ``torch.manual_seed`` makes the samples
    reproducible. While enabled, torch's fused multi-head-attention fast path
    (``torch.backends.mha.set_fastpath_enabled``, torch 2.3+) is switched off, and restored afterwards: an eval-mode
    :class:`torch.nn.TransformerEncoderLayer` (``batch_first=True``) without gradients would otherwise run one fused
    kernel that skips its dropout modules, and every pass would be identical. Example::

        model.eval()
        with torch.no_grad(), mc_dropout(model):
            probs = torch.stack([model(x).softmax(-1) for _ in range(10)]).mean(0)

    :param module: The model.
    :param enabled: ``False`` leaves the modes alone (a no-op block), so that callers can pass a flag through; a
        Python or NumPy bool (a string such as ``"no"`` is refused, not read as true).
    :raises ValueError: When enabled and the model has no dropout with a rate above 0: every pass would be the
        same, which is not MC dropout (train the model with ``dropout > 0``).
    :return: ``module``.
    """
    layers = dropout_modules(module)
    enabled = check_bool("enabled", enabled, where="mc_dropout")
    if enabled and not layers:
        raise ValueError(
            f"mc_dropout: {type(module).__name__} has no dropout module with a rate above 0, so every pass would be "
            f"identical; build it with dropout > 0 (e.g. Transformer(..., dropout=0.1))"
        )
    previous = [layer.training for layer in layers]
    if enabled:
        for layer in layers:
            layer.train(True)
    try:
        # the fused kernels of torch's eval-mode transformer layers never call their dropout modules
        with mha_fastpath_disabled() if enabled else nullcontext():
            yield module
    finally:
        for layer, mode in zip(layers, previous, strict=True):
            layer.train(mode)
