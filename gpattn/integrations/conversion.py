"""What the timm and Hugging Face conversions share: choosing the blocks, building the gpattn layer, copying the
projection weights, turning a foreign attention mask into gpattn's padding mask, and swapping the modules."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.nn import Linear, Module

from ..attention import AttentionLayer, attention_names, build_attention
from ..validation import check_choice, check_int, check_tensor

#: The ``torch.nn.Linear`` attributes of a gpattn layer that take each source projection (the first that exists).
LINEAR_TARGETS: dict[str, tuple[str, ...]] = {
    "query": ("q_proj", "query_proj"),
    "key": ("k_proj", "key_proj"),
    "value": ("v_proj", "value_proj"),
    "output": ("out_proj",),
}
#: The per-head kernel weights ``(H, p, C)`` of a gpattn layer that take the query and key projections (KEP-SVGP,
#: Primal-Attention: the cosine kernel's :math:`W_q^h, W_k^h`).
HEAD_TARGETS: dict[str, str] = {"query": "features.kernel.query_weight", "key": "features.kernel.key_weight"}
#: An additive mask entry at or below this value hides its key (HF's ``torch.finfo(dtype).min``, timm's ``-inf``,
#: the ``-10000`` of older Hugging Face models); 0 shows it; anything else is a bias, not a padding mask.
MASKED_BELOW = -1e4

Projection = tuple[Tensor, Tensor | None]


def resolve_blocks(blocks: Sequence[int], count: int, where: str) -> list[int]:
    """Non-negative indices of the chosen attention modules.

    :param blocks: Indices into the ``count`` attention modules of a model, negative ones counting from the end.
    :param count: How many there are.
    :param where: The caller, for the messages.
    :return: The indices in ``[0, count)``, in the given order.
    :raises ValueError: An index out of range, a repeated module, or no index.
    """
    if isinstance(blocks, (str, bytes)) or not isinstance(blocks, Sequence):
        raise TypeError(f"{where}: expected blocks to be a sequence of integers (e.g. (-1,)), got {blocks!r}")
    if not blocks:
        raise ValueError(f"{where}: expected at least one block index, got {blocks!r}")
    indices = [
        check_int(f"blocks[{i}]", block, -count, count - 1, where=where) % count for i, block in enumerate(blocks)
    ]
    if len(set(indices)) != len(indices):
        raise ValueError(f"{where}: blocks {tuple(blocks)} name the same attention module twice")
    return indices


def build_layer(
    attention: str, embed_dim: int, num_heads: int, layer_options: Mapping[str, Any], like: Tensor, where: str
) -> AttentionLayer:
    """The registry's layer for one converted module, on ``like``'s device and dtype.

    :param attention: A name of :func:`~gpattn.attention.attention_names`.
    :param embed_dim: The module's token width :math:`C`.
    :param num_heads: The module's head count :math:`H`.
    :param layer_options: Further arguments of the layer class.
    :param like: A parameter of the converted module (any shape): the layer takes its device and dtype.
    :param where: The caller and the module, for the messages.
    :return: The layer.
    :raises TypeError: ``embed_dim`` or ``num_heads`` in ``layer_options``, or an argument the layer does not take.
    :raises ValueError: A head count or width the layer cannot take (e.g. ``num_inducing`` above the head width).
    """
    fixed = sorted({"embed_dim", "num_heads"} & set(layer_options))
    if fixed:
        raise TypeError(f"{where}: {fixed} come from the converted model; remove them from the layer options")
    try:
        layer = build_attention(attention, embed_dim, num_heads, **layer_options)
    except (TypeError, ValueError) as error:
        raise type(error)(
            f"{where}: cannot build {attention!r} for embed_dim={embed_dim}, num_heads={num_heads} (head width "
            f"{embed_dim // num_heads}): {error}"
        ) from error
    return layer.to(device=like.device, dtype=like.dtype)


def copy_projections(layer: AttentionLayer, projections: Mapping[str, Projection]) -> tuple[str, ...]:
    r"""Copy a converted module's projections into the gpattn layer's parameters that play the same role.

    ``projections`` maps ``"query"``, ``"key"``, ``"value"`` and ``"output"`` to a weight of shape ``(C, C)`` (as
    ``torch.nn.Linear`` stores it, rows grouped by head: row :math:`h p + d` is dimension :math:`d` of head
    :math:`h`) and a bias of shape ``(C,)`` or ``None``. Copied, where the layer has them:

    * the ``torch.nn.Linear`` of :data:`LINEAR_TARGETS`: ``q_proj``/``k_proj``/``v_proj`` (softmax), ``query_proj``
      and ``key_proj`` (symmetric SVGP), ``key_proj`` and ``value_proj`` (SGPA, whose tied :math:`W_q = W_k` takes
      the keys), ``query_proj``/``key_proj``/``value_proj`` (CGPT, whose ``latent_proj`` starts fresh),
      ``out_proj`` (every layer); a bias with the source's bias, or zeros when the source has none (a source bias
      without a target bias is dropped: of the query, key and value projections only the softmax layer's have biases);
    * the per-head kernel weights of :data:`HEAD_TARGETS`, ``features.kernel.query_weight`` and ``key_weight`` of
      shape ``(H, p, C)`` (KEP-SVGP, Primal-Attention; only ``query_weight`` with ``tie_qk``) as the head blocks
      :math:`W^h` of the weight, when the feature dimension :math:`p` equals the head width (the cosine kernel
      normalises its features, so it has no bias).

    Everything else starts fresh (variational parameters, singular values, amortised maps, inducing keys, the GP
    layers' output maps, which replace the value projection). Only values are copied: the layer's parameters keep
    their own ``requires_grad=True``, so a converted layer is trainable as a whole even where the source weights were
    frozen (set ``requires_grad_(False)`` on the copied names afterwards to keep them fixed), and a projection that
    two converted modules shared becomes two independent parameters (one copy in each layer).

    :param layer: The gpattn layer, on the device and dtype of the projections.
    :param projections: ``role -> (weight, bias)``.
    :return: The names of the parameters that were copied, e.g. ``("q_proj.weight", "q_proj.bias", ...)``.
    :raises ValueError: A role other than those four, a weight not ``(C, C)`` or a bias not ``(C,)`` for the layer's
        width ``C`` (skipped silently before, or broadcast into the bias).
    """
    width = layer.embed_dim
    for role, (weight, bias) in projections.items():  # all checked before anything is copied
        if role not in LINEAR_TARGETS:
            raise ValueError(f"copy_projections: expected the roles {list(LINEAR_TARGETS)}, got {role!r}")
        if tuple(weight.shape) != (width, width):
            raise ValueError(
                f"copy_projections: expected the {role} weight of shape (C, C) = ({width}, {width}) for the layer's "
                f"width, got shape {tuple(weight.shape)}"
            )
        if bias is not None and tuple(bias.shape) != (width,):
            raise ValueError(
                f"copy_projections: expected the {role} bias of shape (C,) = ({width},) or None, got shape "
                f"{tuple(bias.shape)}"
            )
    copied: list[str] = []
    with torch.no_grad():
        for role, (weight, bias) in projections.items():
            name = next((name for name in LINEAR_TARGETS[role] if isinstance(getattr(layer, name, None), Linear)), None)
            linear = getattr(layer, name) if name else None
            if linear is not None and linear.weight.shape == weight.shape:
                linear.weight.copy_(weight)
                copied.append(f"{name}.weight")
                if linear.bias is not None:
                    if bias is None:
                        linear.bias.zero_()
                    else:
                        linear.bias.copy_(bias)
                    copied.append(f"{name}.bias")
            path = HEAD_TARGETS.get(role)
            heads = _attribute(layer, path) if path else None  # None e.g. for the key weight of a tied kernel
            # (H, p, C) takes the (H p, C) weight when p is the head width
            if heads is not None and heads.numel() == weight.numel() and heads.shape[-1] == weight.shape[-1]:
                heads.copy_(weight.reshape(heads.shape))
                copied.append(path)
    return tuple(copied)


def _attribute(module: Module, path: str) -> Tensor | None:
    """The tensor at a dotted attribute path (``features.kernel.query_weight``), or ``None`` where it is missing."""
    value = module
    for part in path.split("."):
        value = getattr(value, part, None)
        if value is None:
            return None
    return value if isinstance(value, Tensor) else None


def padding_mask(attention_mask: Tensor | None, batch: int, length: int, where: str = "padding_mask") -> Tensor | None:
    r"""gpattn's padding mask from the mask an attention module of timm or transformers receives.

    The mask follows :func:`torch.nn.functional.scaled_dot_product_attention`: a tensor of shape ``(B, H, N, N)``
    or broadcastable to it (``(B, 1, 1, N)``, ``(N, N)``, ...), either boolean (``True``: the query
    may attend to the key; timm, transformers' ``sdpa`` masks) or additive (0 for a visible key, a value
    :math:`\leq -10^4` or :math:`-\infty` for a hidden one; transformers' ``eager`` masks hold
    ``torch.finfo(dtype).min``). gpattn's layers take a key padding mask, so the mask must be the same for every
    query and head, except that the row of a padding query may hide every key: the symmetric mask ``valid[q] &
    valid[k]`` (timm's NaFlexViT) is read as the key mask ``valid``. The outputs at padding queries then differ from
    the replaced module's, which are no attention of real tokens either (a uniform average over every token for
    ``torch.finfo(dtype).min``, zeros or NaN for :math:`-\infty`); the real tokens' outputs are the same.

    :param attention_mask: The mask, or ``None``.
    :param batch: :math:`B`.
    :param length: :math:`N`, the sequence length.
    :param where: The caller, for the messages.
    :return: ``None``, or a boolean mask of shape ``(B, N)``, ``True`` for the keys every real query may see.
    :raises ValueError: A shape that does not broadcast to ``(B, H, N, N)``, an additive mask with other values than
        0 and hidden ones (an attention bias), or a mask that differs between the real queries or heads (e.g.
        causal).

    .. note:: Cost: O(B H N^2) elementwise, the size of the mask.
    """
    if attention_mask is None:
        return None
    check_tensor("attention_mask", attention_mask, where=where)
    if attention_mask.dtype == torch.bool:
        visible = attention_mask
    elif attention_mask.is_floating_point():
        visible = attention_mask == 0
        if not bool((visible | (attention_mask <= MASKED_BELOW)).all()):
            nan = bool(attention_mask.isnan().any())  # min and max would both read NaN
            got = "NaN entries" if nan else f"values in [{float(attention_mask.min())}, {float(attention_mask.max())}]"
            raise ValueError(
                f"{where}: an additive attention mask must hold 0 for visible keys and a value <= {MASKED_BELOW:g} "
                f"(or -inf) for hidden ones, got {got}" + ("" if nan else ": an attention bias is not a padding mask")
            )
    else:
        raise TypeError(
            f"{where}: expected a boolean or additive (floating) attention mask, got {attention_mask.dtype}"
        )
    if not 2 <= visible.dim() <= 4:
        raise ValueError(f"{where}: expected an attention mask of shape (B, H, N, N), got {tuple(visible.shape)}")
    visible = visible.reshape((1,) * (4 - visible.dim()) + tuple(visible.shape))
    try:
        visible = visible.expand(batch, visible.shape[1], length, length)
    except RuntimeError as error:
        raise ValueError(
            f"{where}: expected an attention mask broadcastable to (B, H, N, N) = ({batch}, H, {length}, {length}), "
            f"got {tuple(attention_mask.shape)}"
        ) from error
    key_mask = visible[:, 0].any(dim=1)  # the keys some query of the first head sees; (B, 0) for an empty sequence
    shared = (visible == key_mask[:, None, None, :]).all(dim=-1)  # shape: (B, H, N)
    padding_rows = ~visible.any(dim=-1) & ~key_mask[:, None, :]  # a padding query that sees nothing
    if not bool((shared | padding_rows).all()):
        raise ValueError(
            f"{where}: the attention mask differs between queries or heads (e.g. a causal mask), beyond padding "
            "queries that see no key; gpattn's layers convert encoders with key padding masks only"
        )
    return key_mask


class AttentionAdapter(torch.nn.Module):
    """A gpattn layer in the place of a foreign attention module: subclasses map the foreign call to
    ``layer(x, mask)`` and return what the surrounding block expects.

    :param layer: The gpattn layer.
    :param copied: The names of the layer's parameters copied from the replaced module (:func:`copy_projections`).
    :param path: Where in the model the replaced module sat (its first place, for a module shared by several), named
        by the errors of a call; ``""``: not known.

    :ivar layer: The gpattn layer: its ``kl_divergence()``, ``posterior`` and added loss terms are the GP parts of
        the converted model.
    :ivar copied: As given.
    :ivar path: As given.

    .. note:: Cost: the layer's, plus what a subclass spends translating the call (e.g. a mask check).
    """

    def __init__(self, layer: AttentionLayer, copied: tuple[str, ...] = (), path: str = ""):
        super().__init__()
        if not isinstance(layer, AttentionLayer):
            raise TypeError(f"{type(self).__name__}: expected a gpattn AttentionLayer, got {type(layer).__name__}")
        self.layer = layer
        self.copied = tuple(copied)
        self.path = str(path)

    @property
    def where(self) -> str:
        """The adapter in its calls' error messages: its class and, when known, the path it replaced."""
        path = self.__dict__.get("path", "")  # (an adapter pickled before the path was kept has none)
        return f"{type(self).__name__} ({path})" if path else type(self).__name__

    def extra_repr(self) -> str:
        return f"copied={list(self.copied)}"


def convert_modules(
    model: torch.nn.Module,
    is_slot: Callable[[torch.nn.Module], bool],
    blocks: Sequence[int],
    attention: str,
    make_adapter: Callable[[str, torch.nn.Module], dict[str, torch.nn.Module]],
    expected: str,
    where: str,
) -> torch.nn.Module:
    """Replace the chosen attention modules of ``model`` by adapters, all or none.

    :param model: The model, changed in place.
    :param is_slot: Whether a module is an attention module that can be converted, or an :class:`AttentionAdapter`
        that replaced one: ``blocks`` indexes these modules in model order.
    :param blocks: Indices into the slots (negative from the end).
    :param attention: The registry name (checked before anything is built).
    :param make_adapter: ``(name, module) -> {qualified name: new module}``: the adapter under ``name``, and any
        other module it displaces (e.g. an output projection that moves into the gpattn layer). Every replacement is
        built, and every path resolved and checked, before the first module is replaced, so an error leaves the
        model as it was.
    :param expected: What an attention module is, for the message when there is none.
    :param where: The caller, for the messages.
    :return: ``model``; every replacement is in the training mode of the module it replaces.
    :raises ValueError: No slot, a bad or converted index, the model itself as the slot, a path ``make_adapter``
        names that does not exist, or a sharing the replacement would break (below).

    A module in several places of the model (e.g. ``blocks[1].attn = blocks[0].attn``; ``named_modules`` lists it
    once, so it is one slot, at its first path) is replaced at every place by the same adapter: the sharing stays.
    Each displaced module is replaced at the same path relative to every place of the slot, and must be the same
    module there (else the conversion is refused, naming the paths: one adapter cannot stand for two output
    projections); where it also serves an attention module that is not converted, it stays there.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{where}: expected a torch.nn.Module, got {type(model).__name__}")
    check_choice("attention", attention, attention_names(), where=where)
    slots = [(name, module) for name, module in model.named_modules() if is_slot(module)]
    if not slots:
        raise ValueError(f"{where}: {type(model).__name__} has no attention module to convert (expected {expected})")
    chosen = [slots[index] for index in resolve_blocks(blocks, len(slots), where)]
    converted = [name for name, module in chosen if isinstance(module, AttentionAdapter)]
    if converted:
        raise ValueError(f"{where}: {converted} are already converted")
    if any(name == "" for name, _ in chosen):  # converted in place: the model cannot replace itself
        raise ValueError(
            f"{where}: the model is itself an attention module ({type(model).__name__}); convert a model that holds "
            "it, e.g. torch.nn.Sequential(module)"
        )
    paths = _paths(model)
    plan: dict[str, tuple[torch.nn.Module, torch.nn.Module]] = {}  # path -> (the module there now, its replacement)
    for name, module in chosen:
        replacements = make_adapter(name, module)
        olds = {path: _resolve(model, path, where) for path in replacements}
        for place in paths[id(module)]:  # a shared module: the same replacements at each of its places
            for path, replacement in replacements.items():
                target = _move(path, name, place)
                if target is None or _resolve(model, target, where, missing=None) is not olds[path]:
                    raise ValueError(
                        f"{where}: the attention module at {paths[id(module)]} is shared, but {path!r}, replaced "
                        f"with it, is not the same module at {target or 'its other places'}; unshare the modules"
                    )
                plan[target] = (olds[path], replacement)
    for path, (old, replacement) in plan.items():  # everything resolved and checked: nothing fails from here
        replacement.train(old.training)  # the replaced module's mode (e.g. eval: no sampling)
        parent, _, child = path.rpartition(".")  # Module.set_submodule, which torch 2.1 lacks
        setattr(model.get_submodule(parent), child, replacement)
    return model


def _paths(model: torch.nn.Module) -> dict[int, list[str]]:
    """Every qualified name of every submodule of ``model`` (``named_modules`` lists a shared module once), by
    ``id``, in model order."""
    paths: dict[int, list[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(module), []).append(path)
    return paths


def _move(path: str, name: str, place: str) -> str | None:
    """Where ``path``, replaced with the slot at ``name``, sits relative to the slot's other place ``place``: the
    same path from the place's parent (``place`` itself for ``name``), or ``None`` outside the slot's parent."""
    if place == name:
        return path
    if path == name:
        return place
    parent, place_parent = name.rpartition(".")[0], place.rpartition(".")[0]
    if parent and not path.startswith(f"{parent}."):
        return None
    relative = path[len(parent) + 1 :] if parent else path
    return f"{place_parent}.{relative}" if place_parent else relative


_NO_DEFAULT = object()


def _resolve(model: torch.nn.Module, path: str, where: str, missing: Any = _NO_DEFAULT) -> Any:
    """``model.get_submodule(path)``; ``missing`` where there is none, or a ``ValueError`` naming the path."""
    try:
        return model.get_submodule(path)
    except AttributeError as error:
        if missing is not _NO_DEFAULT:
            return missing
        raise ValueError(f"{where}: {type(model).__name__} has no module at {path!r} to replace") from error
