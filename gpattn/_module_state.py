"""Module state helpers shared across the package: copies of modules whose last call left results on an autograd
graph (:class:`GraphFreeState`), train/eval modes restored module by module (:func:`restored_modes`), and the results
of the last call that a training step's loss reads kept across read-only calls (:func:`kept_call_results`)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

__all__ = ["GraphFreeState", "kept_call_results", "restored_modes"]


def _on_graph(value: Any) -> bool:
    # a tensor on an autograd graph (not a leaf), which deepcopy and pickle refuse
    return isinstance(value, Tensor) and value.grad_fn is not None


def _detached(value: Any) -> Any:
    return value.detach() if _on_graph(value) else value


class GraphFreeState:
    """A base for modules that keep results of their last forward call on that call's autograd graph (an added loss
    term such as the KSVD penalty, a per-call KL): ``copy.deepcopy`` and ``pickle`` accept graph leaves only, so the
    state they copy holds those results detached (same values, no graph).

    :meth:`__getstate__` returns a shallow copy of the instance dictionary in which every tensor attribute that is not
    a graph leaf is detached, every added loss term holding such a tensor is replaced by a copy with it detached, and
    GPyTorch's memos (``_memoize_cache``: e.g. a KSVD memoised in eval mode, recomputed on demand) are emptied; the
    module itself is left as it is (its terms still reach the graph for the backward pass of the step). Cost O(the
    number of attributes); no tensor is copied (the copy's detached tensors share the storage until deepcopy copies
    them).
    """

    def __getstate__(self) -> dict:
        # torch's Module.__getstate__ first (it leaves out what Module.compile() set, which a copy must not share)
        state = {name: _detached(value) for name, value in super().__getstate__().items()}
        if "_memoize_cache" in state:
            state["_memoize_cache"] = {}
        terms = state.get("_added_loss_terms")
        if terms:
            state["_added_loss_terms"] = type(terms)((name, _detached_term(term)) for name, term in terms.items())
        return state


def _detached_term(term: Any) -> Any:
    # an added loss term with its tensor attributes detached (a copy), or the term itself when none is on a graph
    attributes = getattr(term, "__dict__", {})
    if not any(_on_graph(value) for value in attributes.values()):
        return term
    duplicate = copy.copy(term)
    duplicate.__dict__.update({name: _detached(value) for name, value in attributes.items()})
    return duplicate


@contextmanager
def restored_modes(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Within the block the modes of ``module`` and its submodules may change (e.g. ``module.eval()``); on exit each
    gets back its own ``training`` flag, so that mixed modes survive (a submodule left in eval mode inside a model in
    training, e.g. a frozen part), which ``module.train(was_training)`` would flatten. A module whose flag changed is
    restored by its own ``train(mode)`` (parents first, as ``train`` recurses), so that modules which act on a change
    of mode (GPyTorch's variational strategies clear their caches) see it; a module shared by two parents of different
    modes, which the second parent's ``train`` would set again, then gets its flag back directly.

    .. note:: Cost O(number of submodules) on entry; on exit O(size of the subtree) per module whose mode changed.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"restored_modes: expected a torch.nn.Module, got {type(module).__name__}")
    modes = [(child, child.training) for child in module.modules()]  # parents before their children
    try:
        yield module
    finally:
        for child, mode in modes:
            if child.training != mode:
                child.train(mode)
        for child, mode in modes:  # shared modules, set again by a later parent's train()
            child.training = mode


@contextmanager
def kept_call_results(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Within the block ``module`` may be called (e.g. in eval mode, for a prediction); on exit every submodule gets
    back the added loss terms (GPyTorch's ``_added_loss_terms``: the KSVD penalty, a per-sequence KL) and the attributes
    it names in ``call_results`` (e.g. a KL that belongs to the call) that it had on entry, so that a read-only call
    between a training step's forward pass and its loss leaves that loss as the forward pass set it (an eval-mode call
    clears the KSVD penalty, and SGPA's replaces its per-sequence KL).

    .. note:: Cost O(number of submodules) on entry and on exit; no tensor is copied.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"kept_call_results: expected a torch.nn.Module, got {type(module).__name__}")
    terms, results = [], []
    for child in module.modules():
        if isinstance(getattr(child, "_added_loss_terms", None), dict):
            terms.append((child, dict(child._added_loss_terms)))
        names = getattr(child, "call_results", ())
        if names:
            results.append((child, {name: getattr(child, name) for name in names}))
    try:
        yield module
    finally:
        for child, saved in terms:
            child._added_loss_terms.update(saved)
        for child, saved in results:
            for name, value in saved.items():
                setattr(child, name, value)
