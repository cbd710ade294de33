"""First derivatives only: the guard of the hand-written autograd functions whose backward pass reuses intermediates of
their forward pass (:func:`first_derivatives_only`).

Such a backward pass computes the right first derivatives, but autograd cannot differentiate it again: the saved
intermediates (feature columns, scores, norms, Cholesky products) were computed inside the forward pass, so they are
not connected to the inputs in the graph. ``backward(create_graph=True)`` through it would give a second derivative
that silently misses every term through those intermediates (measured: a gradient penalty on a KEP-SVGP layer came
out zero for every parameter, or off by the terms through the singular values); ``torch.autograd.function.
once_differentiable`` does not prevent that either (its error node is reached only when the penalty is differentiated
with respect to the first derivative's own outputs, so a gradient with respect to the parameters is silently
``None``). The guard refuses the second derivative instead, with the function's name.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from .._torch_compat import is_compiling

__all__ = ["first_derivatives_only"]


def first_derivatives_only(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate the ``backward`` of the autograd function ``name``: called with grad mode on (``create_graph=True``,
    the first step of a second derivative) outside ``torch.compile``'s tracing, it raises a ``RuntimeError`` naming
    the function; otherwise it runs as written.

    .. note:: Cost: one ``torch.is_grad_enabled()`` per backward call.
    """

    def decorate(backward: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(backward)
        def checked(ctx: Any, *grads: Any) -> Any:
            if torch.is_grad_enabled() and not is_compiling():
                raise RuntimeError(
                    f"{name}: second derivatives are not implemented (its backward pass reuses intermediates of the "
                    "forward pass, which autograd does not track), so backward with create_graph=True through it is "
                    "refused rather than giving a second derivative that misses their terms"
                )
            return backward(ctx, *grads)

        return checked

    return decorate
