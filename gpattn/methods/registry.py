"""The rows of the comparison by name: every registered attention is a row, and :data:`METHODS` adds or refines rows
(a training recipe, MC dropout, an ensemble, a paper), the way :data:`~gpattn.attention.ATTENTIONS` registers layers.

``gpattn compare --attentions`` accepts :func:`method_names`; a run resolves its row once, with :func:`get_method`,
into a :class:`~gpattn.methods.MethodSpec` that everything downstream reads (no code tests a row's name).
"""

from __future__ import annotations

from ..attention import accepts_argument, attention_arguments, attention_names
from .method_spec import MethodSpec
from .predictive import Predictive
from .recipe import TrainingRecipe

__all__ = ["METHODS", "get_method", "method_names", "register_method", "resolve_method", "unregister_method"]

_KEP = "Chen et al., ICML 2024"
_PRIMAL = "Chen et al., NeurIPS 2023"

#: name -> :class:`~gpattn.methods.MethodSpec` of the rows with a description, a recipe or a predictive of their own;
#: a registered attention without an entry is a row of its own name with the defaults (:func:`get_method`).
METHODS: dict[str, MethodSpec] = {
    spec.name: spec
    for spec in (
        MethodSpec(
            "kep_svgp",
            "kep_svgp",
            description="KEP-SVGP, gpattn's variant: amortised kernel-eigen features, a left/right SVGP pair, joint "
            "sampling, sum-form KSVD",
            paper=_KEP,
        ),
        MethodSpec(
            "kep_svgp_sym",
            "kep_svgp_sym",
            description="the symmetric KEP ablation: W_q = W_k makes the kernel symmetric PSD",
            paper=_KEP,
        ),
        MethodSpec(
            "sgpa",
            "sgpa",
            recipe=TrainingRecipe(kl_anneal_fraction=0.5),
            description="SGPA: symmetric kernel, decoupled SVGP with amortised and global inducing keys; its KL weight "
            "annealed from 0 over the first half of the run (its official recipe); kl_weighting='elbo' (the layer's "
            "default: each sequence's KL once and the global KL by 1/n, an ELBO; 'official' adds the whole KL to "
            "every sequence as the official code does)",
            paper="Chen & Li, ICLR 2023",
        ),
        MethodSpec(
            "svgp",
            "svgp",
            description="a standard whitened GPyTorch SVGP per head on the projected tokens",
            paper="Hensman et al., AISTATS 2015",
        ),
        MethodSpec(
            "softmax",
            "softmax",
            description="canonical multi-head scaled dot-product attention (deterministic)",
            paper="Vaswani et al., NeurIPS 2017",
        ),
        MethodSpec(
            "primal",
            "primal",
            description="Primal-Attention, gpattn's variant: deterministic KSVD scores, amortised features, KSVD loss",
            paper=_PRIMAL,
        ),
        MethodSpec(
            "cgpt",
            "cgpt",
            description="CGPT: an asymmetric kernel as the cross-covariance of two GPs correlated through a latent GP",
            paper="Bui et al., 2024",
        ),
        MethodSpec(
            "kep_svgp_paper",
            "kep_svgp_paper",
            description="KEP-SVGP as its official code runs it (docs/guide/papers.md)",
            paper=_KEP,
        ),
        MethodSpec(
            "primal_paper",
            "primal_paper",
            description="Primal-Attention as its official code runs it (docs/guide/papers.md)",
            paper=_PRIMAL,
        ),
        MethodSpec(
            "softmax_mc_dropout",
            "softmax",
            predictive=Predictive("mc_dropout"),
            description="MC dropout: softmax trained with dropout on the embeddings, every attention output and the "
            "MLPs, evaluated with dropout on, averaging the Monte Carlo passes",
            paper="Gal & Ghahramani, ICML 2016",
        ),
        MethodSpec(
            "laplace",
            "softmax",
            predictive=Predictive("laplace"),
            description="last-layer Laplace: the softmax Transformer, then laplace-torch's Kronecker-factored GGN of "
            "its classification head fitted on the training split, prior precision by the marginal likelihood, "
            "predicting with Monte Carlo samples of the GLM predictive's logits",
            paper="Daxberger et al., NeurIPS 2021",
        ),
        MethodSpec(
            "deep_ensemble",
            "softmax",
            predictive=Predictive(members=5),
            temperature_scaled=False,
            description="Deep Ensembles: 5 softmax Transformers trained independently, their probabilities averaged",
            paper="Lakshminarayanan et al., NeurIPS 2017",
        ),
    )
}


def method_names() -> list[str]:
    """The rows ``gpattn compare`` accepts: the registered attentions in registry order (the order of the tables and
    figures), then the other rows of :data:`METHODS` in registration order.

    Example:
        >>> names = method_names()
        >>> names[:3], names[-3:]
        (['kep_svgp', 'kep_svgp_sym', 'sgpa'], ['softmax_mc_dropout', 'laplace', 'deep_ensemble'])
    """
    attentions = attention_names()
    return attentions + [name for name in METHODS if name not in attentions]


def get_method(name: str) -> MethodSpec:
    """The :class:`~gpattn.methods.MethodSpec` of the row ``name``: its entry of :data:`METHODS`, or for a registered
    attention without one the row of that attention with the defaults (no recipe, its own samples, a ``+ts`` row).

    Example:
        >>> spec = get_method("sgpa")
        >>> spec.attention, spec.recipe.kl_anneal_fraction
        ('sgpa', 0.5)
        >>> get_method("softmax_mc_dropout").predictive.kind
        'mc_dropout'

    :param name: One of :func:`method_names`.
    :raises ValueError: An unknown row (the message lists the rows), or a row whose attention is no longer registered
        (or no longer takes the row's arguments).
    :raises TypeError: ``name`` is not a string.
    """
    if not isinstance(name, str):
        raise TypeError(f"expected a comparison row name (a string), got {type(name).__name__}: {name!r}")
    if name in METHODS:
        return _checked(METHODS[name])
    if name in attention_names():
        return MethodSpec(name, name, description=f"the registered attention {name!r}")
    raise ValueError(f"unknown comparison row {name!r}; expected one of {method_names()}")


def resolve_method(method: str | MethodSpec) -> MethodSpec:
    """``method`` as a :class:`~gpattn.methods.MethodSpec`: a row name through :func:`get_method`, a spec as it is
    (after checking that its attention is registered and takes its
    :attr:`~gpattn.methods.MethodSpec.attention_arguments`)."""
    return _checked(method) if isinstance(method, MethodSpec) else get_method(method)


def register_method(spec: MethodSpec) -> None:
    """Register the row ``spec``, after the built-in ones: from then on ``gpattn compare --attentions <spec.name>``
    runs it. A registered attention is already a row; registering a spec of the same name gives it a recipe, a
    predictive or a description of its own.

    Example:
        >>> register_method(MethodSpec("kep_s4", "kep_svgp", attention_arguments={"num_inducing": 4}))
        >>> method_names()[-1]
        'kep_s4'
        >>> unregister_method("kep_s4")

    :raises ValueError: A row of that name is already in :data:`METHODS`, ``spec.attention`` is not a registered
        attention, or ``spec.attention_arguments`` names an argument that attention does not take (refused now, not
        when the first run builds it).
    :raises TypeError: ``spec`` is not a :class:`~gpattn.methods.MethodSpec`.
    """
    if not isinstance(spec, MethodSpec):
        raise TypeError(f"expected a MethodSpec, got {type(spec).__name__}")
    if spec.name in METHODS:
        raise ValueError(f"the comparison row {spec.name!r} is already registered ({METHODS[spec.name]})")
    METHODS[_checked(spec).name] = spec


def unregister_method(name: str) -> None:
    """Remove the row ``name`` from :data:`METHODS` (e.g. at the end of a test that registered it). A registered
    attention stays a row (with the defaults) until :func:`~gpattn.attention.unregister_attention` removes it.

    :raises ValueError: ``name`` is not in :data:`METHODS`.
    :raises TypeError: ``name`` is not a string.
    """
    if not isinstance(name, str):
        raise TypeError(f"expected a comparison row name (a string), got {type(name).__name__}: {name!r}")
    if name not in METHODS:
        raise ValueError(f"the comparison row {name!r} is not registered; registered rows: {list(METHODS)}")
    del METHODS[name]


def _checked(spec: MethodSpec) -> MethodSpec:
    if spec.attention not in attention_names():
        raise ValueError(
            f"the comparison row {spec.name!r} uses the attention {spec.attention!r}, which is not registered; "
            f"expected one of {attention_names()}"
        )
    unknown = sorted(key for key in spec.attention_arguments if not accepts_argument(spec.attention, key))
    if unknown:
        raise ValueError(
            f"the comparison row {spec.name!r} passes {unknown} to the attention {spec.attention!r}, which takes "
            f"{attention_arguments(spec.attention)}"
        )
    return spec
