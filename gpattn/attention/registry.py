"""Attention layers by name: a new attention is one file plus one line in :data:`ATTENTIONS` (or one call of
:func:`register_attention` from outside the package).

Everything that runs attentions by name (:class:`~gpattn.models.Transformer`, ``gpattn compare``, its figures) reads
this registry: the names and their order (:func:`attention_names`, the order of tables and figure colours), the
arguments a layer accepts (:func:`attention_arguments`, :func:`select_arguments`) and the layer itself
(:func:`build_attention`).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from ..validation import keyword_arguments
from ._base import AttentionLayer
from .cgpt_attention import CGPTAttention
from .kep_svgp_attention import KEPSVGPAttention
from .primal_attention import PrimalAttention
from .sgpa_attention import SGPAAttention
from .softmax_attention import SoftmaxAttention
from .symmetric_svgp_attention import SymmetricSVGPAttention

#: KEP-SVGP as its official code runs it (the model it trains; its KL formula and its KL weight without 1/n are not
#: reproduced, see docs/guide/papers.md). Its primal-token weights have N' = min(max_len, 10 s) rows (the official
#: CIFAR and IMDB layers' rank_multi = 10) formed from each sequence's real tokens, so that padding has no influence;
#: the official CoLA layer, whose weights read the padded sequence, is
#: feature_options={"rank_multiple": 2, "padding": "included"} (docs/guide/papers.md)
PAPER_KEP_SVGP: dict[str, Any] = {
    "features": "primal_tokens",
    "max_len": 512,
    "shared_posterior": True,
    "sampling": "marginal",
    "num_outputs": "num_inducing",
    "ksvd_form": "official",
}
#: Primal-Attention as its official code runs it (the same primal-token weights)
PAPER_PRIMAL: dict[str, Any] = {"features": "primal_tokens", "max_len": 512, "ksvd_form": "official"}

#: name -> (layer class, default keyword arguments). Every class takes ``(embed_dim, num_heads, **kwargs)``.
ATTENTIONS: dict[str, tuple[type[AttentionLayer], dict[str, Any]]] = {
    # KEP-SVGP (Chen et al. 2024): asymmetric cosine kernel, left/right kernel-eigen SVGP pair
    "kep_svgp": (KEPSVGPAttention, {}),
    # the symmetric KEP ablation: W_q = W_k makes the kernel symmetric PSD (docs/math.md section 5)
    "kep_svgp_sym": (KEPSVGPAttention, {"tie_qk": True}),
    # SGPA (Chen & Li 2023): symmetric kernel, decoupled SVGP with amortised and global inducing keys
    "sgpa": (SGPAAttention, {}),
    # a standard whitened GPyTorch SVGP per head on the projected tokens
    "svgp": (SymmetricSVGPAttention, {}),
    # canonical multi-head scaled dot-product attention (deterministic)
    "softmax": (SoftmaxAttention, {}),
    # Primal-Attention (Chen et al. 2023): deterministic KSVD scores, KSVD loss
    "primal": (PrimalAttention, {}),
    # CGPT (Bui et al. 2024): asymmetric kernel as the cross-covariance of two GPs correlated through a latent GP
    "cgpt": (CGPTAttention, {}),
    # the rows above named after a paper are gpattn's versions (amortised features, joint sampling, sum-form KSVD);
    # the two below are the papers' methods as their official code runs them (docs/guide/papers.md): the official
    # parametrisation W_e|X = X~_h^T W~_e (features="primal_tokens"), the official KSVD number, and for KEP-SVGP one
    # shared q(u), per-token (marginal) sampling and d_out = s. max_len is the longest sequence: a Transformer passes
    # its own; the default 512 (the Transformer's) samples 10 s evenly spaced tokens of each sequence's real tokens
    "kep_svgp_paper": (KEPSVGPAttention, PAPER_KEP_SVGP),
    "primal_paper": (PrimalAttention, PAPER_PRIMAL),
}


def attention_names() -> list[str]:
    """The registered attention names.

    :return: The keys of :data:`ATTENTIONS`, in registry order (the order of the comparison's tables and figures).
    """
    return list(ATTENTIONS)


def _layer_class(name: str) -> type[AttentionLayer]:
    if not isinstance(name, str):
        raise TypeError(f"expected an attention name to be a string, got {type(name).__name__}: {name!r}")
    if name not in ATTENTIONS:
        raise ValueError(f"unknown attention {name!r}; expected one of {attention_names()}")
    return ATTENTIONS[name][0]


def _arguments(layer_cls: type[AttentionLayer]) -> list[str]:
    # the named keyword arguments besides embed_dim and num_heads (not *args, **kwargs or positional-only ones)
    return keyword_arguments(layer_cls, ("embed_dim", "num_heads"))


def _takes_any(layer_cls: type[AttentionLayer]) -> bool:
    # **kwargs in the signature: any keyword argument is accepted
    parameters = inspect.signature(layer_cls).parameters.values()
    return any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters)


def attention_arguments(name: str) -> list[str]:
    """The keyword arguments the layer registered as ``name`` names besides ``embed_dim`` and ``num_heads``
    (e.g. to pass ``num_inducing`` only to the layers that have one). A class that also takes ``**kwargs`` accepts
    any other keyword (see :func:`accepts_argument`), which is not listed here.

    :param name: One of :func:`attention_names`.
    :return: Argument names, in signature order.
    """
    return _arguments(_layer_class(name))


def accepts_argument(name: str, argument: str) -> bool:
    """Whether the layer registered as ``name`` accepts the keyword ``argument``: one of its
    :func:`attention_arguments`, or any keyword when its class takes ``**kwargs``.

    Example:
        >>> accepts_argument("softmax", "dropout"), accepts_argument("softmax", "num_inducing")
        (True, False)

    :param name: One of :func:`attention_names`.
    :param argument: A keyword argument name.
    :return: ``True`` if :func:`build_attention` passes it on.
    """
    layer_cls = _layer_class(name)
    return argument in _arguments(layer_cls) or _takes_any(layer_cls)


def select_arguments(name: str, **settings: Any) -> dict[str, Any]:
    """The shared ``settings`` that the layer registered as ``name`` takes: how a runner passes one setting (e.g.
    ``num_inducing`` or ``ksvd_weight``) to every attention that has it. A setting the layer does not name
    (:func:`attention_arguments`) is left out, also for a class that takes ``**kwargs`` (which would accept it but
    may not use it), and so is a ``None`` value (the layer then uses its own default).

    Example:
        >>> select_arguments("softmax", num_inducing=8, ksvd_weight=1.0)
        {}
        >>> select_arguments("primal", num_inducing=None, ksvd_weight=1.0)
        {'ksvd_weight': 1.0}

    :param name: One of :func:`attention_names`.
    :param settings: Candidate keyword arguments.
    :return: The keyword arguments for :func:`build_attention`.
    """
    accepted = attention_arguments(name)
    return {key: value for key, value in settings.items() if value is not None and key in accepted}


def build_attention(name: str, embed_dim: int, num_heads: int, **kwargs: Any) -> AttentionLayer:
    """Build the attention layer registered as ``name``.

    :param name: One of :func:`attention_names`.
    :param embed_dim: Token width :math:`C`.
    :param num_heads: Number of heads (must divide ``embed_dim``).
    :param kwargs: Keyword arguments of the layer class (:func:`attention_arguments`, or any keyword for a class
        that takes ``**kwargs``); they override the registry defaults.
    :return: The layer, an :class:`~gpattn.attention.AttentionLayer`.
    """
    layer_cls = _layer_class(name)
    accepted = attention_arguments(name)
    unknown = [] if _takes_any(layer_cls) else sorted(set(kwargs) - set(accepted))
    if unknown:
        raise TypeError(f"{layer_cls.__name__} ({name!r}) got unexpected arguments {unknown}; it accepts {accepted}")
    return layer_cls(embed_dim, num_heads, **{**ATTENTIONS[name][1], **kwargs})


def register_attention(name: str, layer_cls: type[AttentionLayer], defaults: Mapping[str, Any] | None = None) -> None:
    """Register an attention layer under ``name``, after the built-in ones: from then on the
    :class:`~gpattn.models.Transformer`, ``gpattn compare`` (``--attentions name``) and its figures know it.

    Example:
        >>> from gpattn.attention import SoftmaxAttention
        >>> class MyAttention(SoftmaxAttention):
        ...     '''Softmax attention under another name.'''
        >>> register_attention("mine", MyAttention)
        >>> attention_names()[-1]
        'mine'
        >>> unregister_attention("mine")

    :param name: A new name (a non-empty string without spaces).
    :param layer_cls: A subclass of :class:`~gpattn.attention.AttentionLayer` taking ``(embed_dim, num_heads,
        **kwargs)``: named keyword arguments (:func:`attention_arguments`), or ``**kwargs`` itself (then any keyword is
        passed on; a :class:`~gpattn.models.Transformer` passes its ``dropout`` to layers that accept one).
    :param defaults: Keyword arguments passed to every layer built under ``name`` (overridden by the caller's).
    :raises ValueError: ``name`` is taken or malformed, or ``defaults`` names an argument the class does not take (or
        ``embed_dim``, ``num_heads``, which build_attention passes itself).
    :raises TypeError: ``layer_cls`` is not an ``AttentionLayer`` subclass, or does not take two positional arguments.
    """
    if not isinstance(name, str) or not name or any(character.isspace() for character in name):
        raise ValueError(f"expected the attention name to be a non-empty string without spaces, got {name!r}")
    if name in ATTENTIONS:
        raise ValueError(f"the attention {name!r} is already registered ({ATTENTIONS[name][0].__name__})")
    if not (isinstance(layer_cls, type) and issubclass(layer_cls, AttentionLayer)):
        raise TypeError(f"expected layer_cls to be a subclass of AttentionLayer, got {layer_cls!r}")
    signature = inspect.signature(layer_cls)
    try:  # the layers are built as layer_cls(embed_dim, num_heads, **kwargs): refused now, not at the first build
        signature.bind_partial(0, 0)
    except TypeError as error:
        raise TypeError(
            f"expected layer_cls to take (embed_dim, num_heads, **kwargs), but {layer_cls.__name__}{signature} does "
            f"not take two positional arguments ({error})"
        ) from None
    defaults = dict(defaults or {})
    positional = sorted({"embed_dim", "num_heads"} & set(defaults))  # a **kwargs class would take them, then clash
    if positional:
        raise ValueError(
            f"defaults {positional} are build_attention's own arguments (build_attention(name, embed_dim, num_heads)), "
            "not defaults"
        )
    unknown = [] if _takes_any(layer_cls) else sorted(set(defaults) - set(_arguments(layer_cls)))
    if unknown:
        raise ValueError(f"defaults {unknown} are not arguments of {layer_cls.__name__} ({_arguments(layer_cls)})")
    ATTENTIONS[name] = (layer_cls, defaults)


def unregister_attention(name: str) -> None:
    """Remove the attention registered as ``name`` (e.g. at the end of a test that registered it).

    :param name: One of :func:`attention_names`.
    :raises ValueError: ``name`` is not registered.
    """
    _layer_class(name)
    del ATTENTIONS[name]
