r"""The search space of ``gpattn tune`` (:func:`search_space`): the same shared parameters for every row, plus each
row's own, as the comparison protocol declares them.

* **Shared**: the peak learning rate ``lr`` log-uniform on :math:`[3 \cdot 10^{-4}, 10^{-2}]`, AdamW's
  ``weight_decay`` log-uniform on :math:`[10^{-4}, 0.3]`, ``dropout`` uniform on :math:`[0, 0.3]` (the MC-dropout
  row predicts with it), and the ``architecture`` (width x depth x heads) from :data:`ARCHITECTURES`.
* **KL weight** ``beta`` log-uniform on :math:`[10^{-2}, n]` (:math:`n` training sequences) for the rows whose
  attention is a variational layer with a KL term (its own :meth:`~gpattn.attention.AttentionLayer.kl_divergence`:
  KEP-SVGP, its paper variant, SGPA, the symmetric SVGP; not CGPT, stochastic but without a KL, where :math:`\beta`
  would change nothing): :math:`\beta = 1` is the ELBO weight :math:`1/n` of gpattn's loss
  :math:`\mathrm{CE} + (\beta / n)\,\mathrm{KL}`, :math:`\beta = n` the official codes' per-batch weight; both are
  inside the interval.
* **KSVD weight** ``ksvd_weight`` (:math:`\eta`) log-uniform on :math:`[10^{-2}, 10^2]` for the rows whose layer
  takes one (KEP-SVGP and Primal-Attention, gpattn's and the papers' variants).
* **KL annealing** ``kl_anneal_fraction`` one of 0, 0.25, 0.5 for the rows whose recipe anneals the KL weight
  (:attr:`~gpattn.methods.TrainingRecipe.kl_anneal_fraction` > 0: SGPA).

Every trial trains at most :data:`MAX_EPOCHS` epochs with early stopping on the validation NLL after
:data:`PATIENCE` epochs without improvement. The rules read the row registry (the layer class of the row's attention
and the row's recipe), so a newly registered row gets the parameters its layer has.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..attention import ATTENTIONS, AttentionLayer, attention_arguments
from ..methods import get_method
from ..validation import InputTypeError, check_choice, check_float, check_int

__all__ = [
    "ARCHITECTURES",
    "MAX_EPOCHS",
    "PARAMETER_BUDGET",
    "PATIENCE",
    "TUNED_ROWS",
    "TUNING_SEED",
    "SearchParameter",
    "architecture_sizes",
    "hyperparameter_values",
    "search_space",
    "search_space_text",
]

#: The rows ``gpattn tune`` tunes by default (PROTOCOL): every single-model row of the main table. Deep Ensembles and
#: the last-layer Laplace row use softmax's configuration (they wrap it), the ``+ts`` rows need none.
TUNED_ROWS = ("softmax", "softmax_mc_dropout", "sgpa", "kep_svgp", "kep_svgp_paper", "primal", "primal_paper")
#: The seed of every tuning run (model initialisation, batch order, noise): not one of the evaluation seeds 0-9, nor a
#: member seed of their ensembles (:func:`~gpattn.training.member_seed`: 0-49 for 5 members).
TUNING_SEED = 100
#: The largest parameter count of the softmax model of an architecture candidate (MNIST-1D's signal model).
PARAMETER_BUDGET = 60_000
#: Early stopping: epochs without a lower validation NLL after which a trial stops.
PATIENCE = 15
#: The most epochs of a trial per task: MNIST-1D's 60 (57 steps an epoch) from the protocol; digits' 100 (14 steps an
#: epoch: 1,400 steps, fewer than MNIST-1D's 3,420, with the same patience); the pointer task's 8 (tests only).
MAX_EPOCHS = {"mnist1d": 60, "digits": 100, "pointer": 8}
#: The architecture candidates ``"<width>x<depth>x<heads>"``: widths 32, 48, 64, depths 1-4 and 2 or 4 heads whose
#: softmax model on MNIST-1D (the protocol's ``Transformer(input="signal", input_dim=1, max_len=40)``, default stem)
#: has at most :data:`PARAMETER_BUDGET` parameters. The head count does not change the count: 14,922 / 23,466 /
#: 32,010 / 40,554 parameters at width 32 and depth 1 / 2 / 3 / 4, 32,362 / 51,322 at width 48 and depth 1 / 2,
#: 56,458 at width 64 and depth 1 (48 x 3 has 70,282, 64 x 2 has 89,930). Every head is at least 8 wide, above the
#: inducing set size 5 of MNIST-1D.
ARCHITECTURES = tuple(
    f"{width}x{depth}x{heads}"
    for width, depths in ((32, (1, 2, 3, 4)), (48, (1, 2)), (64, (1,)))
    for depth in depths
    for heads in (2, 4)
)
#: The kinds of :class:`SearchParameter`.
KINDS = ("log_uniform", "uniform", "choice")
#: The types of a choice besides ``None`` (Optuna's categorical choices).
_CHOICE_TYPES = (bool, int, float, str)


@dataclass(frozen=True)
class SearchParameter:
    """One dimension of a row's search space: a float on ``[low, high]`` (uniform, or uniform in its logarithm), or
    one of ``choices``.

    :ivar name: The parameter (a :class:`~gpattn.methods.Hyperparameters` name, or ``"architecture"``).
    :ivar kind: ``"log_uniform"``, ``"uniform"`` or ``"choice"``.
    :ivar low: Lower end of a float (included).
    :ivar high: Upper end of a float (included).
    :ivar choices: The values of a ``"choice"`` (a non-empty tuple or list, kept as a tuple).

    The bounds are finite numbers (Python's or NumPy's, kept as Python numbers), not bools; a log-uniform range needs
    ``low > 0``.

    :raises InputTypeError: ``name`` is not a string, a bound of a float range is not a number (a string, a bool,
        ``None``), ``choices`` is not a tuple or list (a string would be its letters), or a choice is not ``None``, a
        bool, a number or a string (NumPy scalars are kept as Python ones).
    :raises ValueError: An empty ``name``, an unknown ``kind``, no choices, two choices that compare equal (``1`` and
        ``1.0``, ``True`` and ``1``), a bound that is negative or not finite,
        ``low >= high``, ``low = 0`` in a log-uniform range, or an argument the kind ignores (bounds of a choice,
        choices of a float range).

    Example:
        >>> lr = SearchParameter("lr", "log_uniform", 3e-4, 1e-2)
        >>> lr.describe(), lr.contains(1e-3), lr.contains(0.1)
        ({'log_uniform': [0.0003, 0.01]}, True, False)
    """

    name: str
    kind: str
    low: float | None = None
    high: float | None = None
    choices: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise InputTypeError(f"SearchParameter: expected name to be a non-empty string, got {self.name!r}")
        if not self.name:
            raise ValueError(f"SearchParameter: expected name to be a non-empty string, got {self.name!r}")
        where = f"SearchParameter {self.name!r}"
        check_choice("kind", self.kind, KINDS, where=where)
        if self.kind == "choice":
            if self.low is not None or self.high is not None:  # they would be ignored
                raise ValueError(f"{where}: a choice takes no low or high, got [{self.low}, {self.high}]")
            if not isinstance(self.choices, (tuple, list)):
                raise InputTypeError(f"{where}: expected choices to be a tuple or list of values, got {self.choices!r}")
            if not self.choices:
                raise ValueError(f"{where}: expected choices, got none")
            # NumPy scalars as Python ones (the studies' settings and the tuned files are JSON)
            choices = tuple(choice.item() if isinstance(choice, np.generic) else choice for choice in self.choices)
            wrong = [choice for choice in choices if choice is not None and not isinstance(choice, _CHOICE_TYPES)]
            if wrong:  # Optuna stores a categorical's choices as JSON scalars
                raise InputTypeError(
                    f"{where}: expected choices to be None, bools, numbers or strings, got {wrong[0]!r}"
                )
            for index, choice in enumerate(choices):  # Optuna finds a stored choice by ==: a repeat would read back
                repeats = [other for other in choices[:index] if _equal(other, choice)]  # as the first (True as 1)
                if repeats:
                    raise ValueError(
                        f"{where}: expected distinct choices, got {repeats[0]!r} and {choice!r}, which compare equal "
                        "(Optuna finds a choice by ==; a repeat also weighs it twice): give each once"
                    )
            object.__setattr__(self, "choices", choices)
            return
        if self.choices:  # they would be ignored (an empty sequence: none given)
            raise ValueError(f"{where}: a {self.kind} range takes no choices, got {self.choices!r}")
        for label in ("low", "high"):  # NumPy numbers as Python ones (an integer stays one: describe's JSON)
            value = getattr(self, label)
            check_float(label, value, 0.0, where=where)
            object.__setattr__(self, label, int(value) if isinstance(value, numbers.Integral) else float(value))
        if not self.low < self.high:
            raise ValueError(f"{where}: expected 0 <= low < high, got [{self.low}, {self.high}]")
        if self.kind == "log_uniform" and self.low == 0:
            raise ValueError(f"{where}: a log-uniform range needs low > 0, got {self.low}")

    def suggest(self, trial: Any) -> Any:
        """This parameter's value in an Optuna trial (``trial.suggest_float`` or ``trial.suggest_categorical``)."""
        if self.kind == "choice":
            return trial.suggest_categorical(self.name, list(self.choices))
        return trial.suggest_float(self.name, self.low, self.high, log=self.kind == "log_uniform")

    def contains(self, value: Any) -> bool:
        """Whether ``value`` is in this dimension (the ends of a float range included): a number (Python's or NumPy's,
        not a bool) within a float range, or one of the choices (a bool only where the choice is one)."""
        if self.kind == "choice":
            return any(_is_bool(value) == _is_bool(choice) and _equal(value, choice) for choice in self.choices)
        return not _is_bool(value) and isinstance(value, numbers.Real) and self.low <= value <= self.high

    def describe(self) -> dict[str, list[Any]]:
        """``{kind: [low, high]}`` or ``{"choice": [...]}``: the dimension as JSON data (the tuned files' record)."""
        return {self.kind: list(self.choices) if self.kind == "choice" else [self.low, self.high]}


def _is_bool(value: Any) -> bool:
    return isinstance(value, (bool, np.bool_))


def _equal(value: Any, choice: Any) -> bool:
    try:
        return bool(value == choice)
    except (TypeError, ValueError):  # e.g. an array, whose == is elementwise
        return False


def _has_kl(layer: type) -> bool:
    """Whether the attention layer class has a KL term (a variational layer that defines its own ``kl_divergence``;
    the base class's is zero)."""
    return layer.is_stochastic and layer.kl_divergence is not AttentionLayer.kl_divergence


def _shared() -> tuple[SearchParameter, ...]:
    return (
        SearchParameter("lr", "log_uniform", 3e-4, 1e-2),
        SearchParameter("weight_decay", "log_uniform", 1e-4, 0.3),
        SearchParameter("dropout", "uniform", 0.0, 0.3),
        SearchParameter("architecture", "choice", choices=ARCHITECTURES),
    )


def search_space(row: str, num_train: int) -> tuple[SearchParameter, ...]:
    """The search space of the row ``row`` on a task with ``num_train`` training sequences: the shared parameters,
    then the row's own (see the module docstring), in the order a trial samples them.

    Example:
        >>> [parameter.name for parameter in search_space("sgpa", 3600)]
        ['lr', 'weight_decay', 'dropout', 'architecture', 'beta', 'kl_anneal_fraction']
        >>> search_space("kep_svgp", 3600)[4].describe()
        {'log_uniform': [0.01, 3600]}

    :param row: A row of :func:`~gpattn.methods.method_names`.
    :param num_train: Training sequences :math:`n`, the upper end of :math:`\\beta`.
    :raises ValueError: An unknown row, or ``num_train < 1``.
    """
    check_int("num_train", num_train, where="search_space")
    method = get_method(row)
    space = list(_shared())
    if _has_kl(ATTENTIONS[method.attention][0]):
        space.append(SearchParameter("beta", "log_uniform", 1e-2, num_train))
    if "ksvd_weight" in attention_arguments(method.attention):
        space.append(SearchParameter("ksvd_weight", "log_uniform", 1e-2, 1e2))
    if method.recipe.kl_anneal_fraction > 0:
        space.append(SearchParameter("kl_anneal_fraction", "choice", choices=(0.0, 0.25, 0.5)))
    return tuple(space)


def architecture_sizes(architecture: str) -> dict[str, int]:
    """The Transformer sizes of an architecture label ``"<width>x<depth>x<heads>"``.

    Example:
        >>> architecture_sizes("48x2x4")
        {'embed_dim': 48, 'depth': 2, 'num_heads': 4}

    :raises ValueError: A label that is not three positive integers (ASCII digits) joined by ``x``.
    """
    parts = architecture.split("x") if isinstance(architecture, str) else []
    if len(parts) != 3 or not all(part.isascii() and part.isdigit() and int(part) > 0 for part in parts):
        raise ValueError(f"expected an architecture '<width>x<depth>x<heads>' such as '32x2x2', got {architecture!r}")
    return dict(zip(("embed_dim", "depth", "num_heads"), map(int, parts), strict=True))


def hyperparameter_values(parameters: dict[str, Any]) -> dict[str, Any]:
    """A trial's ``parameters`` (name -> value of :func:`search_space`) as :class:`~gpattn.methods.Hyperparameters`
    names (the architecture as ``embed_dim``, ``depth``, ``num_heads``), for
    :meth:`~gpattn.methods.Hyperparameters.updated`.

    Example:
        >>> hyperparameter_values({"lr": 1e-3, "architecture": "32x1x4"})
        {'lr': 0.001, 'embed_dim': 32, 'depth': 1, 'num_heads': 4}
    """
    values = {name: value for name, value in parameters.items() if name != "architecture"}
    if "architecture" in parameters:
        values.update(architecture_sizes(parameters["architecture"]))
    return values


def search_space_text(rows: tuple[str, ...] = TUNED_ROWS) -> str:
    """The search space in one paragraph (``gpattn tune --help`` and the docs): the shared parameters, then each row
    parameter with the rows of ``rows`` that have it (:math:`n`: the task's training sequences)."""
    shared = [_text(parameter) for parameter in _shared()]
    own: dict[str, tuple[str, list[str]]] = {}
    for row in rows:
        for parameter in search_space(row, 1)[len(shared) :]:
            own.setdefault(parameter.name, (_text(parameter), []))[1].append(row)
    parts = [f"{text} for {', '.join(names)}" for text, names in own.values()]
    epochs = ", ".join(f"{task} {epochs}" for task, epochs in MAX_EPOCHS.items())
    return (
        f"shared: {'; '.join(shared)}; " + "; ".join(parts) + f"; at most {epochs} epochs with early stopping on the "
        f"validation NLL (patience {PATIENCE})"
    )


def _text(parameter: SearchParameter) -> str:
    """``"lr log-uniform [0.0003, 0.01]"``, ``"beta log-uniform [0.01, n]"``, ``"architecture ... one of ..."``."""
    if parameter.kind == "choice":
        values = " ".join(f"{value:g}" if isinstance(value, float) else str(value) for value in parameter.choices)
        label = " (width x depth x heads)" if parameter.name == "architecture" else ""
        return f"{parameter.name}{label} one of {values}"
    kind = "log-uniform" if parameter.kind == "log_uniform" else "uniform"
    high = "n" if parameter.name == "beta" else f"{parameter.high:g}"
    return f"{parameter.name} {kind} [{parameter.low:g}, {high}]"
