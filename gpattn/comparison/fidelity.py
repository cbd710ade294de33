"""The KSVD fidelity of a model's KSVD layers in the comparison: :func:`~gpattn.features.ksvd_fidelity` on the tokens
every KEP-SVGP / Primal-Attention layer receives, for the trained model, the same model at initialisation and random
subspaces (the chance level), so that a value can be read against both.

A run's record holds, per layer (``"layer_<l>"``, from 1) and per head, every field of
:class:`~gpattn.features.KSVDFidelity` (the trained model and the ``random_*`` chance level of its kernel), the same
fields of the model at initialisation prefixed ``initial_`` (:data:`INITIAL_FIELDS`) and the layer's rank ``rank``
(:math:`s`, to read ``effective_rank`` against).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import torch
from torch import Tensor

from .._module_state import kept_call_results, restored_modes
from .._torch_compat import eager_calls
from ..features import AttentionKernelEigenFeatures, KSVDFidelity, ksvd_fidelity
from ..features.ksvd_fidelity import DEFAULT_RANDOM_SAMPLES
from ..training import batch_to_device, dataset_inputs
from ..validation import check_int, check_seed

__all__ = ["INITIAL_FIELDS", "INITIAL_PREFIX", "model_fidelity"]

#: The prefix of the fields measured on the model at initialisation.
INITIAL_PREFIX = "initial_"
#: The fields of :class:`~gpattn.features.KSVDFidelity` also measured at initialisation (all but the chance level,
#: which is a property of the sequence lengths and the rank, and of the trained kernel).
INITIAL_FIELDS = tuple(field.name for field in fields(KSVDFidelity) if not field.name.startswith("random_"))


def _ksvd_layers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    # the layers with kernel-eigen features, numbered from 1 among all attention layers
    layers = getattr(model, "attention_layers", None)
    if layers is None:
        return []
    return [
        (index, layer)
        for index, layer in enumerate(layers(), start=1)
        if isinstance(getattr(layer, "features", None), AttentionKernelEigenFeatures)
    ]


def _ranks(layers: list[tuple[int, torch.nn.Module]]) -> list[tuple[int, int]]:
    return [(number, layer.features.num_inducing) for number, layer in layers]


@torch.no_grad()
def _layer_inputs(
    model: torch.nn.Module, layers: list[tuple[int, torch.nn.Module]], inputs: Tensor, mask: Tensor | None
) -> dict[int, tuple[Tensor, Tensor | None]]:
    # the tokens (and padding mask) every layer receives in one eval-mode pass, captured by forward pre-hooks
    captured: dict[int, tuple[Tensor, Tensor | None]] = {}

    def capture(number: int):
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            layer_mask = kwargs.get("mask", args[1] if len(args) > 1 else None)
            captured[number] = (args[0].detach(), layer_mask if isinstance(layer_mask, Tensor) else None)

        return hook

    handles = [layer.register_forward_pre_hook(capture(n), with_kwargs=True) for n, layer in layers]
    try:
        # a compiled model runs eagerly here: its compiled graphs would skip the hooks
        with restored_modes(model), kept_call_results(model), eager_calls():
            model.eval()(inputs, mask=mask)
    finally:
        for handle in handles:
            handle.remove()
    return captured


def _measure(
    layer: torch.nn.Module, queries: Tensor, mask: Tensor | None, random_samples: int, seed: int
) -> KSVDFidelity | None:
    # ksvd_fidelity on the sequences with at least s real tokens; None when there are none
    rank = layer.features.num_inducing
    if rank > queries.shape[-2]:
        return None
    if mask is not None:
        keep = mask.sum(-1) >= rank
        if not bool(keep.any()):
            return None
        queries, mask = queries[keep], mask[keep]
    return ksvd_fidelity(layer, queries, key_mask=mask, random_samples=random_samples, seed=seed)


def _per_head(fidelity: KSVDFidelity, names: tuple[str, ...], prefix: str = "") -> dict[str, list[float]]:
    # the mean over sequences of every field, one value per head
    return {prefix + name: getattr(fidelity, name).double().mean(dim=0).tolist() for name in names}


@torch.no_grad()
def model_fidelity(
    model: torch.nn.Module,
    dataset: Any,
    max_sequences: int = 256,
    initial: torch.nn.Module | None = None,
    *,
    random_samples: int = DEFAULT_RANDOM_SAMPLES,
    seed: int = 0,
) -> dict[str, dict[str, list[float]]]:
    """:func:`~gpattn.features.ksvd_fidelity` of every KSVD layer (KEP-SVGP, Primal-Attention: a layer with
    :class:`~gpattn.features.AttentionKernelEigenFeatures` as ``.features``) of a trained model, on the tokens that
    the layer receives when the model reads the first ``max_sequences`` inputs of ``dataset`` (captured by a forward
    pre-hook during one eval-mode pass), averaged over those sequences per head; with ``initial``, the same for the
    model at initialisation on the same inputs (its own layers, on the tokens they receive from its own, untrained,
    lower blocks).

    :param model: A :class:`~gpattn.models.Transformer` (anything with ``attention_layers()``).
    :param dataset: Has ``.tokens`` (and ``.mask``), ``.images`` or ``.inputs``.
    :param max_sequences: Sequences to measure on.
    :param initial: The model built with the same arguments and seed before training, or ``None``.
    :param random_samples: Random frames per sequence and head of the chance level
        (:func:`~gpattn.features.ksvd_fidelity`).
    :param seed: Seed of the random frames.
    :return: ``"layer_<l>"`` (from 1) -> field -> one value per head: every field of
        :class:`~gpattn.features.KSVDFidelity`, ``"initial_<field>"`` for :data:`INITIAL_FIELDS` when ``initial`` is
        given, and ``"rank"`` (:math:`s`); ``{}`` for a model without KSVD layers. A layer whose rank :math:`s`
        exceeds the sequence length is left out (the exact KSVD has fewer than :math:`s` singular vectors), and so
        are the padded sequences with fewer than :math:`s` real tokens.
    :raises ValueError: ``initial`` has other KSVD layers than ``model``; ``max_sequences`` or ``random_samples``
        below 1, a negative ``seed`` (``TypeError`` for a non-integer; checked before anything runs).

    .. note:: Cost: one forward pass over the sequences (two with ``initial``) plus, per KSVD layer, the dense kernel
        and its SVD per sequence and head and ``random_samples`` random frames
        (:func:`~gpattn.features.ksvd_fidelity`).
    """
    check_int("max_sequences", max_sequences, where="model_fidelity")
    # before the forward pass, and also when no layer gets measured (every rank above the sequence length)
    check_int("random_samples", random_samples, where="model_fidelity")
    check_seed("seed", seed, where="model_fidelity")
    layers = _ksvd_layers(model)
    if not layers:
        return {}
    initial_layers = None if initial is None else _ksvd_layers(initial)
    if initial_layers is not None and _ranks(initial_layers) != _ranks(layers):
        raise ValueError(
            f"model_fidelity: the initial model has KSVD layers (number, rank) {_ranks(initial_layers)}, the trained "
            f"model {_ranks(layers)}: pass the model built with the same arguments and seed before training"
        )
    inputs, mask = dataset_inputs(dataset)
    index = torch.arange(min(max_sequences, inputs.shape[0]))
    batch_inputs, batch_mask = batch_to_device(inputs, mask, index, next(model.parameters()).device)
    captured = _layer_inputs(model, layers, batch_inputs, batch_mask)
    initial_captured = {}
    if initial is not None:
        initial_inputs, initial_mask = batch_to_device(inputs, mask, index, next(initial.parameters()).device)
        initial_captured = _layer_inputs(initial, initial_layers, initial_inputs, initial_mask)
    names = tuple(field.name for field in fields(KSVDFidelity))
    result = {}
    for position, (number, layer) in enumerate(layers):
        fidelity = _measure(layer, *captured[number], random_samples, seed)
        if fidelity is None:
            continue  # a rank above the sequence length: no top-s subspace to compare with (e.g. s = 10, 8 tokens)
        values = _per_head(fidelity, names)
        if initial is not None:
            initial_layer = initial_layers[position][1]
            before = _measure(initial_layer, *initial_captured[number], random_samples, seed)
            values.update(_per_head(before, INITIAL_FIELDS, INITIAL_PREFIX))
        values["rank"] = [float(layer.features.num_inducing)] * len(values["kernel_error"])
        result[f"layer_{number}"] = values
    return result
