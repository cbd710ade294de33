"""Convert the self-attention of Hugging Face encoders (BERT, RoBERTa, DistilBERT, ViT) to gpattn layers. Needs the
``huggingface`` extra: ``pip install gpattn[huggingface]``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..attention import AttentionLayer
from ..validation import InputTypeError
from .conversion import MASKED_BELOW, AttentionAdapter, build_layer, convert_modules, copy_projections, padding_mask

WHERE = "gpattn.integrations.huggingface.convert_attention"


@dataclass(frozen=True)
class SelfAttentionLayout:
    """Where a family's self-attention module keeps its projections.

    :ivar query: Attribute of the query ``torch.nn.Linear``.
    :ivar key: Attribute of the key ``torch.nn.Linear``.
    :ivar value: Attribute of the value ``torch.nn.Linear``.
    :ivar heads: Attribute holding the head count.
    :ivar output: Path of the output projection ``torch.nn.Linear``: from the module itself, or from its parent
        when ``output_in_parent`` (BERT keeps it in ``BertAttention.output.dense``, after ``BertSelfAttention``).
    :ivar output_in_parent: See ``output``.
    """

    query: str
    key: str
    value: str
    heads: str
    output: str
    output_in_parent: bool = False


_BERT = SelfAttentionLayout("query", "key", "value", "num_attention_heads", "output.dense", output_in_parent=True)

#: Self-attention class name -> layout (transformers 5). Register another encoder family's bidirectional
#: self-attention here; its forward must be ``(hidden_states, attention_mask=None, **kwargs) -> (output, weights)``.
LAYOUTS: dict[str, SelfAttentionLayout] = {
    "BertSelfAttention": _BERT,
    "RobertaSelfAttention": _BERT,
    "DistilBertSelfAttention": SelfAttentionLayout("q_lin", "k_lin", "v_lin", "n_heads", "out_lin"),
    "ViTAttention": SelfAttentionLayout("q_proj", "k_proj", "v_proj", "num_attention_heads", "o_proj"),
}


class HuggingFaceAttentionAdapter(AttentionAdapter):
    r"""A gpattn layer with the call of a transformers self-attention module:
    ``(hidden_states, attention_mask=None, **kwargs) -> (output, None)`` (the attention weights of the replaced
    module are not defined: ``None``).

    ``attention_mask`` is the mask the encoder builds for its layers: a 4-D boolean mask (``sdpa``), a 4-D additive
    mask (``eager``, :math:`-\infty`/``torch.finfo(dtype).min`` on padding) or a 2-D ``(B, N)`` mask, either a
    keep-mask (boolean, or 0/1 integers or floats: 1 = real token, the form of the ``attention_mask`` argument of
    the model and of the flash-attention path) or an additive one (floats, 0 = real token, a value
    :math:`\leq -10^4` or :math:`-\infty` = padding; a floating mask of zeros only, which could be either, is
    refused); it becomes gpattn's
    boolean padding mask (:func:`~gpattn.integrations.padding_mask`); a 2-D mask of other values is refused. Other
    keyword arguments the encoder passes (``position_ids``, ...) are ignored. Refused, as the layer cannot do what
    they ask: cross-attention, cached decoding, head masks, ``output_attentions=True`` (the layer has no attention
    weights: the model's ``attentions`` would silently lack this layer's entry, the later layers' shifted to its
    index), ``is_causal=True``, the packed sequences of ``cu_seq_lens_q``/``cu_seq_lens_k``, and the ``BlockMask``
    of ``flex_attention`` (use ``sdpa`` or ``eager``). ``output_attentions`` is read as transformers reads it: the
    call's argument when the model is called with one, else ``config.output_attentions`` (transformers then records
    the weights with hooks on the replaced class and passes nothing down).

    :param layer: The gpattn layer.
    :param copied: The names of the layer's parameters copied from the replaced module.
    :param config: The replaced module's ``config`` (the model's, shared), or ``None``.
    :param path: As :class:`~gpattn.integrations.AttentionAdapter`'s.

    :ivar config: As given: its ``output_attentions`` is checked at every call.

    .. note:: Cost: the layer's, plus O(B H N^2) to check a 4-D mask.
    """

    def __init__(self, layer: AttentionLayer, copied: tuple[str, ...] = (), config: Any = None, path: str = ""):
        super().__init__(layer, copied, path)
        self.config = config

    def forward(
        self, hidden_states: Tensor, attention_mask: Tensor | None = None, **kwargs: Any
    ) -> tuple[Tensor, None]:
        """Attend, as the replaced module did.

        :param hidden_states: Tokens, shape ``(B, N, C)``.
        :param attention_mask: ``None``, ``(B, N)`` (a keep-mask, 1 = real token, or an additive mask, 0 = real
            token) or the encoder's 4-D mask ``(B, 1, N, N)``.
        :param kwargs: Further arguments of the encoder's call.
        :return: The output ``(B, N, C)`` and ``None`` for the attention weights.
        :raises ValueError: Cross-attention, a cache, a head mask, ``output_attentions=True`` (the call's, else the
            config's), ``is_causal=True``, packed sequences, or a mask that is neither a keep-mask nor an additive
            padding mask.
        :raises InputTypeError: A mask that is not a tensor (``flex_attention``'s ``BlockMask``).
        """
        where = self.where
        # transformers 5 passes the cache as ``cache`` (``past_key_values`` before)
        refused = [
            key
            for key in ("encoder_hidden_states", "cache", "past_key_values", "head_mask")
            if kwargs.get(key) is not None
        ]
        if refused:
            raise ValueError(f"{where}: a converted encoder layer supports self-attention only, got {refused}")
        if "output_attentions" in kwargs:  # the call's flag overrides the config's, as in transformers
            requested, source, fix = kwargs["output_attentions"], "", "call the model without it"
        else:  # transformers then records the weights with hooks on the replaced class, and passes nothing down
            requested = getattr(self.config, "output_attentions", False)
            source, fix = "config.", "set model.config.output_attentions = False"
        if requested:
            raise ValueError(
                f"{where}: got {source}output_attentions=True, but a gpattn layer has no attention weights (the "
                f"model's attentions would lack the converted layers and shift the others); {fix}"
            )
        if kwargs.get("is_causal"):
            raise ValueError(
                f"{where}: got is_causal=True; a converted encoder layer attends bidirectionally, with a key padding "
                "mask at most"
            )
        packed = [key for key in ("cu_seq_lens_q", "cu_seq_lens_k") if kwargs.get(key) is not None]
        if packed:
            raise ValueError(
                f"{where}: got {packed} (sequences packed into one row); a converted encoder layer takes a batch of "
                "padded sequences and a padding mask"
            )
        if attention_mask is not None and not isinstance(attention_mask, Tensor):  # e.g. flex_attention's BlockMask
            raise InputTypeError(
                f"{where}: expected attention_mask to be a torch.Tensor, got {type(attention_mask).__name__}; a "
                "BlockMask comes from attn_implementation='flex_attention': switch the model to 'sdpa' or 'eager' "
                "(model.set_attn_implementation('sdpa'))"
            )
        batch, length = hidden_states.shape[:2]
        if attention_mask is not None and attention_mask.dim() == 2:  # (B, N): as SDPA's (B, 1, 1, N)
            attention_mask = _key_mask(attention_mask, where)[:, None, None, :]
        return self.layer(hidden_states, mask=padding_mask(attention_mask, batch, length, where=where)), None


def _key_mask(attention_mask: Tensor, where: str) -> Tensor:
    r"""A 2-D ``(B, N)`` attention mask as a boolean keep-mask (``True``: real token) or, when it is additive, as it is.

    Boolean masks are keep-masks; integer masks must hold 0/1 (1 = real token). A floating mask of 0/1 values with
    at least one 1 is a keep-mask; a floating mask of 0 and values :math:`\leq -10^4` or :math:`-\infty` with at least
    one of those is additive, returned unchanged for :func:`~gpattn.integrations.padding_mask`.

    :raises ValueError: Any other values (e.g. 0.5, NaN, or 1 beside a hidden value): neither form; or a floating mask
        of zeros only, which is either (a keep-mask that hides every token, an additive mask that hides none).
    """
    if attention_mask.dtype == torch.bool:
        return attention_mask
    one = attention_mask == 1
    binary = bool(((attention_mask == 0) | one).all())
    floating = attention_mask.is_floating_point()
    if floating and not bool(attention_mask.any()):
        raise ValueError(
            f"{where}: a floating 2-D attention_mask of zeros only is ambiguous: a keep-mask that hides every token or "
            "an additive mask that hides none; pass None (no padding) or a boolean mask"
        )
    if binary and (not floating or bool(one.any())):
        return one
    if floating and bool(((attention_mask == 0) | (attention_mask <= MASKED_BELOW)).all()):
        return attention_mask
    if floating and bool(attention_mask.isnan().any()):  # min and max would both read NaN
        got = "NaN entries"
    else:
        low, high = (float(value) for value in attention_mask.double().aminmax())
        got = f"values in [{low}, {high}]"
    raise ValueError(
        f"{where}: a 2-D attention_mask must be a keep-mask (1 = real token, 0 = padding) or, floating, an additive "
        f"mask (0 = real token, a value <= {MASKED_BELOW:g} or -inf = padding), got a {attention_mask.dtype} mask "
        f"with {got}"
    )


def _linear(module: torch.nn.Module, path: str, where: str) -> torch.nn.Linear:
    try:
        linear = module.get_submodule(path)
    except AttributeError:
        linear = None
    if not isinstance(linear, torch.nn.Linear):
        raise ValueError(
            f"{where}: expected a torch.nn.Linear at {type(module).__name__}.{path}; this transformers version lays "
            "the module out differently from gpattn.integrations.huggingface.LAYOUTS"
        )
    return linear


def convert_attention(
    model: torch.nn.Module, attention: str = "kep_svgp", blocks: Sequence[int] = (-1,), **layer_options: Any
) -> torch.nn.Module:
    r"""Replace the self-attention of the chosen layers of a Hugging Face encoder by gpattn's ``attention`` layer.

    The self-attention modules are those whose class is in :data:`LAYOUTS` (``BertSelfAttention``,
    ``RobertaSelfAttention``, ``DistilBertSelfAttention``, ``ViTAttention``), in model order: ``blocks=(-1,)``
    converts the last layer. Any model around the encoder works (``BertModel``,
    ``BertForSequenceClassification``, ``ViTForImageClassification``, ...). Each module is replaced by a
    :class:`HuggingFaceAttentionAdapter` holding ``build_attention(attention, C, H, **layer_options)`` on the
    module's device and dtype. The gpattn layer owns the output projection: where the family keeps it outside the
    self-attention (BERT and RoBERTa: ``BertSelfOutput.dense``), it moves into the layer's ``out_proj`` and its old
    place becomes ``torch.nn.Identity`` (the dropout, residual and LayerNorm around it stay). Copied
    (:func:`~gpattn.integrations.copy_projections`): the query, key, value and output projections into every
    parameter of the layer that plays their role (softmax: all four, so that ``attention="softmax"`` reproduces the
    model in eval mode; KEP-SVGP and Primal-Attention: ``out_proj`` and the per-head kernel weights
    :math:`W_q^h, W_k^h`; SGPA: keys, values and output; symmetric SVGP: queries, keys and output; CGPT: queries,
    keys, values and output); the rest
    starts fresh and the adapter's ``copied`` lists what was copied. Every parameter of the layer is trainable, the
    copied ones too, whatever the ``requires_grad`` of the replaced weights (freeze them after the conversion if
    wanted, e.g. by the names in ``copied``). The attention-weight dropout of the module has no counterpart (the
    layer's ``dropout`` acts on its output; default 0). A module shared by several places (a weight-shared encoder)
    counts once in ``blocks`` and is replaced at every place by one adapter
    (:func:`~gpattn.integrations.convert_modules`).

    A pretrained model takes the same path: ``AutoModelForSequenceClassification.from_pretrained(name)`` then
    ``convert_attention(model, ...)``, then fine-tune with :class:`~gpattn.mlls.AttentionELBO` (which reads the
    ``logits`` of the model's output).

    :param model: A transformers model, changed in place.
    :param attention: A name of :func:`~gpattn.attention.attention_names`.
    :param blocks: Indices of the self-attention modules to convert, negative ones from the end.
    :param layer_options: Keyword arguments of the layer (e.g. ``num_inducing=8``), besides ``embed_dim`` and
        ``num_heads``, which come from the module.
    :return: ``model``.
    :raises ValueError: No self-attention module of :data:`LAYOUTS`, an index out of range or already converted, an
        unknown attention name, a causal (decoder) self-attention, a module whose attention width or query, key,
        value or output projection differs from its token width (``(C, C)`` weights), a head count or width the
        layer cannot take, or a sharing between modules that the conversion would break.

    .. note:: Cost: building the layers and copying O(C^2) weights per converted layer.

    Example:

        >>> from transformers import BertConfig, BertForSequenceClassification
        >>> from gpattn.integrations.huggingface import convert_attention
        >>> config = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
        >>> model = convert_attention(BertForSequenceClassification(config), "kep_svgp", num_inducing=8)
    """

    def make_adapter(name: str, module: torch.nn.Module) -> dict[str, torch.nn.Module]:
        where = f"{WHERE} ({name})"
        layout = LAYOUTS[type(module).__name__]
        if getattr(module, "is_causal", False):
            raise ValueError(f"{where}: causal (decoder) self-attention is not supported; convert encoders")
        owner = name.rpartition(".")[0] if layout.output_in_parent else name
        query, key, value = (_linear(module, path, where) for path in (layout.query, layout.key, layout.value))
        parent = model.get_submodule(owner)
        beside = layout.output.split(".")[0]  # the parent's module that holds the output projection
        if layout.output_in_parent and not isinstance(getattr(parent, beside, None), torch.nn.Module):
            # the output projection sits beside this module, in its parent (BertAttention: self, output.dense)
            raise ValueError(
                f"{where}: the output projection of a {type(module).__name__} is its parent's {layout.output} (as in "
                f"BertAttention), but its parent {type(parent).__name__} has none: convert a model that holds the "
                "whole attention block"
            )
        output = _linear(parent, layout.output, where)
        width = query.in_features
        widths = {"token width": width, "attention width": query.out_features, "output width": output.out_features}
        if len(set(widths.values())) != 1:
            raise ValueError(f"{where}: gpattn layers map (B, N, C) to (B, N, C); this module has {widths}")
        shapes = {
            role: tuple(linear.weight.shape) for role, linear in (("key", key), ("value", value), ("output", output))
        }
        other = {role: shape for role, shape in shapes.items() if shape != (width, width)}
        if other:
            raise ValueError(
                f"{where}: expected the key, value and output projections to map the token width C = {width} to "
                f"itself (weight shape ({width}, {width})), got weight shapes {other}"
            )
        layer = build_layer(attention, width, getattr(module, layout.heads), layer_options, query.weight, where)
        projections = {
            role: (linear.weight, linear.bias)
            for role, linear in (("query", query), ("key", key), ("value", value), ("output", output))
        }
        copied = copy_projections(layer, projections)
        replacements = {name: HuggingFaceAttentionAdapter(layer, copied, getattr(module, "config", None), name)}
        if layout.output_in_parent:  # owner is "" when the model is the BertAttention itself
            replacements[f"{owner}.{layout.output}" if owner else layout.output] = torch.nn.Identity()
        return replacements

    def is_slot(module: torch.nn.Module) -> bool:
        return type(module).__name__ in LAYOUTS or isinstance(module, HuggingFaceAttentionAdapter)

    expected = f"a self-attention module of {sorted(LAYOUTS)}"
    return convert_modules(model, is_slot, blocks, attention, make_adapter, expected, WHERE)
