"""A comparison row as data (:class:`MethodSpec`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..attention import select_arguments
from ..validation import InputTypeError
from .predictive import Predictive
from .recipe import TrainingRecipe

__all__ = ["MethodSpec"]


class _Arguments(dict):
    """The keyword arguments a :class:`MethodSpec` holds: its own copy, read-only (a frozen spec, also one read from
    the registry, does not change), a ``dict`` otherwise (spread, compared, JSON), pickled and copied as its items."""

    def _read_only(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("a MethodSpec's arguments are read-only; make a new spec (dataclasses.replace) to change them")

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _read_only

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (dict(self),)


@dataclass(frozen=True)
class MethodSpec:
    """One row of the comparison, resolved from its name once (:func:`~gpattn.methods.get_method`) and read by the run:
    what is trained (a :class:`~gpattn.models.Transformer` with a registered attention), how, and how it predicts.

    :ivar name: The row's name (``gpattn compare --attentions <name>``, the records' ``attention`` and their file
        names: no spaces, no path separators).
    :ivar attention: The registered attention (:func:`~gpattn.attention.attention_names`) of the row's GP blocks.
    :ivar attention_arguments: Keyword arguments of that layer fixed by the row (they override the shared settings
        such as ``num_inducing``); ``{}`` for the registry's defaults. The spec holds a read-only copy (as it does of
        :attr:`model_arguments`), which is left out of its hash.
    :ivar model_arguments: Keyword arguments of the :class:`~gpattn.models.Transformer` fixed by the row.
    :ivar recipe: The training recipe (:class:`~gpattn.methods.TrainingRecipe`, e.g. SGPA's KL annealing).
    :ivar predictive: How the trained row predicts (:class:`~gpattn.methods.Predictive`: its own Monte Carlo samples,
        MC dropout, an ensemble of :math:`K` members).
    :ivar temperature_scaled: Whether the comparison adds the post-hoc temperature-scaled ``+ts`` row of it.
    :ivar description: One line saying what the row is.
    :ivar paper: The paper the row follows (``""`` for none).

    Example:
        >>> spec = MethodSpec("kep_s4", attention="kep_svgp", attention_arguments={"num_inducing": 4})
        >>> spec.predictive.members, spec.recipe.kl_anneal_fraction, spec.temperature_scaled
        (1, 0.0, True)
        >>> spec.layer_arguments(num_inducing=8, ksvd_weight=0.5)
        {'num_inducing': 4, 'ksvd_weight': 0.5}
    """

    name: str
    attention: str
    attention_arguments: Mapping[str, Any] = field(default_factory=dict, hash=False)  # hashed: the other fields
    model_arguments: Mapping[str, Any] = field(default_factory=dict, hash=False)
    recipe: TrainingRecipe = field(default_factory=TrainingRecipe)
    predictive: Predictive = field(default_factory=Predictive)
    temperature_scaled: bool = True
    description: str = ""
    paper: str = ""

    def __post_init__(self) -> None:
        for label in ("name", "attention"):
            value = getattr(self, label)
            if not isinstance(value, str):
                raise InputTypeError(
                    f"MethodSpec: expected {label} to be a non-empty string without spaces, got {value!r}"
                )
            if not value or any(character.isspace() for character in value):
                raise ValueError(f"MethodSpec: expected {label} to be a non-empty string without spaces, got {value!r}")
        if "/" in self.name or "\\" in self.name:  # refused now, not when a run's record is written after training
            raise ValueError(
                f"MethodSpec: expected name to be without path separators ('/', '\\'): the records of its runs are "
                f"files named after it (<task>-<name>-<seed>.json), got {self.name!r}"
            )
        for label in ("attention_arguments", "model_arguments"):
            value = getattr(self, label)
            if not isinstance(value, Mapping) or not all(isinstance(key, str) for key in value):
                raise InputTypeError(f"MethodSpec: expected {label} to map argument names to values, got {value!r}")
            object.__setattr__(self, label, _Arguments(value))  # a read-only copy: the caller's dict may change later
        for label, kind in (("recipe", TrainingRecipe), ("predictive", Predictive)):
            if not isinstance(getattr(self, label), kind):
                raise InputTypeError(
                    f"MethodSpec: expected {label} to be a {kind.__name__}, got {getattr(self, label)!r}"
                )
        if not isinstance(self.temperature_scaled, bool):
            raise InputTypeError(
                f"MethodSpec: expected temperature_scaled to be a bool, got {self.temperature_scaled!r}"
            )
        for label in ("description", "paper"):
            if not isinstance(getattr(self, label), str):
                raise InputTypeError(f"MethodSpec: expected {label} to be a string, got {getattr(self, label)!r}")

    def layer_arguments(self, **settings: Any) -> dict[str, Any]:
        """The keyword arguments of the row's attention layer: the shared ``settings`` that the layer takes
        (:func:`~gpattn.attention.select_arguments`, e.g. ``num_inducing`` and ``ksvd_weight``; a ``None`` value is
        left out, so the layer uses its own default), then the row's own :attr:`attention_arguments`, which win."""
        return {**select_arguments(self.attention, **settings), **self.attention_arguments}
