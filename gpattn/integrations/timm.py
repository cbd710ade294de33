"""Convert the attention of timm Vision Transformers (and every timm model built from its ``Attention`` module) to
gpattn layers. Needs the ``timm`` extra: ``pip install gpattn[timm]``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from timm.models.vision_transformer import Attention
from torch import Tensor

from ..attention import accepts_argument
from .conversion import AttentionAdapter, build_layer, convert_modules, copy_projections, padding_mask

WHERE = "gpattn.integrations.timm.convert_attention"


class TimmAttentionAdapter(AttentionAdapter):
    r"""A gpattn layer with the call of timm's ``Attention``: ``(x, attn_mask=None, is_causal=False) -> (B, N, C)``.

    ``attn_mask`` (boolean or additive, broadcastable to ``(B, H, N, N)``, as timm passes it to
    :func:`torch.nn.functional.scaled_dot_product_attention`) becomes gpattn's padding mask
    (:func:`~gpattn.integrations.padding_mask`); ``is_causal=True`` becomes ``mask="causal"``. Both at once are
    refused: timm's fused path (:func:`~torch.nn.functional.scaled_dot_product_attention`, the default) applies both
    masks, its unfused path the causal one only, and gpattn's layers take one mask.

    :param layer: The gpattn layer.
    :param copied: The names of the layer's parameters copied from the replaced module.

    .. note:: Cost: the layer's, plus O(B H N^2) to check a mask when one is given.
    """

    def forward(self, x: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
        """Attend, as the replaced module did.

        :param x: Tokens, shape ``(B, N, C)``.
        :param attn_mask: ``None`` or a key padding mask in timm's form, shape broadcastable to ``(B, H, N, N)``.
        :param is_causal: Causal self-attention.
        :return: Shape ``(B, N, C)``.
        :raises ValueError: ``is_causal=True`` with an ``attn_mask``, or a mask that
            :func:`~gpattn.integrations.padding_mask` refuses.
        """
        if is_causal and attn_mask is not None:
            raise ValueError(
                f"{self.where}: got is_causal=True and an attn_mask; gpattn's layers take a causal mask or a "
                "key padding mask, not both"
            )
        batch, length = x.shape[:2]
        mask = "causal" if is_causal else padding_mask(attn_mask, batch, length, where=self.where)
        return self.layer(x, mask=mask)


def _check_plain(module: Attention, where: str) -> None:
    """Refuse the options of timm's ``Attention`` that a gpattn layer would silently drop."""
    width = module.qkv.in_features
    widths = {
        "token width": width,
        "attention width": module.qkv.out_features // 3,
        "output width": module.proj.out_features,
    }
    if len(set(widths.values())) != 1:
        raise ValueError(
            f"{where}: gpattn layers map (B, N, C) to (B, N, C) with C = heads x head width; this module has "
            f"{widths} ({module.num_heads} heads)"
        )
    extras = {
        "qk_norm": not isinstance(getattr(module, "q_norm", torch.nn.Identity()), torch.nn.Identity),
        "scale_norm": not isinstance(getattr(module, "norm", torch.nn.Identity()), torch.nn.Identity),
        "gated": getattr(module, "gate", None) is not None,
    }
    used = [name for name, on in extras.items() if on]
    if used:
        raise ValueError(f"{where}: the module uses {used}, which gpattn's layers do not have")


def convert_attention(
    model: torch.nn.Module, attention: str = "kep_svgp", blocks: Sequence[int] = (-1,), **layer_options: Any
) -> torch.nn.Module:
    r"""Replace the ``Attention`` modules of the chosen blocks of a timm model by gpattn's ``attention`` layer.

    The attention modules are the instances of timm's ``Attention`` in model order (for a ``VisionTransformer``,
    ``model.blocks[i].attn``): ``blocks=(-1,)`` converts the last one, as the KEP-SVGP paper does. Each is replaced
    by a :class:`TimmAttentionAdapter` holding ``build_attention(attention, C, H, **layer_options)`` on the
    module's device and dtype, so the block calls it as before. Copied from the module
    (:func:`~gpattn.integrations.copy_projections`): the query, key and value thirds of ``qkv`` and the output
    projection ``proj`` into every parameter of the layer that plays their role (softmax: ``q_proj``, ``k_proj``,
    ``v_proj``, ``out_proj``, so that ``attention="softmax"`` reproduces the model; KEP-SVGP and Primal-Attention:
    ``out_proj`` and the per-head kernel weights :math:`W_q^h, W_k^h`; SGPA: ``key_proj``, ``value_proj``,
    ``out_proj``; symmetric SVGP: ``query_proj``, ``key_proj``, ``out_proj``; CGPT: ``query_proj``, ``key_proj``,
    ``value_proj``, ``out_proj``); the rest starts fresh and the
    adapter's ``copied`` lists what was copied. The module's output dropout (``proj_drop``) becomes the layer's
    ``dropout`` unless ``layer_options`` sets one; its attention-weight dropout (``attn_drop``) has no counterpart.

    A pretrained model takes the same path: ``timm.create_model(name, pretrained=True)`` then
    ``convert_attention(model, ...)``, then fine-tune with :class:`~gpattn.mlls.AttentionELBO`.

    :param model: A timm model (``VisionTransformer``, DeiT, ...), changed in place.
    :param attention: A name of :func:`~gpattn.attention.attention_names`.
    :param blocks: Indices of the attention modules to convert, negative ones from the end.
    :param layer_options: Keyword arguments of the layer (e.g. ``num_inducing=8``), besides ``embed_dim`` and
        ``num_heads``, which come from the module.
    :return: ``model``.
    :raises ValueError: No timm ``Attention`` module, an index out of range or already converted, an unknown
        attention name, a module whose widths differ or that uses ``qk_norm``/``scale_norm``/a gate, or a head
        count or width the layer cannot take.

    .. note:: Cost: building the layers and copying O(C^2) weights per converted block.

    Example:

        >>> import timm
        >>> from gpattn.integrations.timm import convert_attention
        >>> model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=4)
        >>> model = convert_attention(model, "kep_svgp", blocks=(-1,), num_inducing=8)
    """

    def make_adapter(name: str, module: Attention) -> dict[str, torch.nn.Module]:
        where = f"{WHERE} ({name})"
        _check_plain(module, where)
        width = module.qkv.in_features
        options = dict(layer_options)
        if accepts_argument(attention, "dropout"):
            options.setdefault("dropout", module.proj_drop.p)
        layer = build_layer(attention, width, module.num_heads, options, module.qkv.weight, where)
        qkv_bias = [None] * 3 if module.qkv.bias is None else module.qkv.bias.chunk(3)
        projections = {
            role: (weight, bias)
            for role, weight, bias in zip(("query", "key", "value"), module.qkv.weight.chunk(3), qkv_bias, strict=True)
        }
        projections["output"] = (module.proj.weight, module.proj.bias)
        return {name: TimmAttentionAdapter(layer, copy_projections(layer, projections), path=name)}

    def is_slot(module: torch.nn.Module) -> bool:
        return isinstance(module, (Attention, TimmAttentionAdapter))

    return convert_modules(model, is_slot, blocks, attention, make_adapter, "timm Attention modules", WHERE)
