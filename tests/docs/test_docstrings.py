"""Every public name of every subpackage is documented, and every docstring of a callable that takes or returns
tensors states their shapes.

The rules, applied to the names in each subpackage's ``__all__`` (constants such as ``ATTENTIONS`` or
``SHIFT_KINDS`` are skipped: they are documented on the API pages by a comment, not a docstring):

* a class or function has a non-empty docstring of its own;
* a class's public methods and properties defined in gpattn (including ``forward`` and ``__call__``, and those it
  inherits from a gpattn base class) have a non-empty docstring, their own or the one of the gpattn method they
  override (what ``inspect.getdoc`` returns and the API reference renders);
* a callable *handles tensors* when an annotation of one of its parameters or of its return value names ``Tensor``
  (``Tensor``, ``Tensor | None``, ``tuple[Tensor, Tensor]``, ``Tensor | np.ndarray``, ...); for a class this is its
  ``__init__``. Its docstring (for a class: the class docstring, which documents ``__init__``) must then state a
  shape: a dimension tuple in double backticks (````(B, N, C)````, ````(*batch, s)````, ````(n,)````), or the word
  ``shape`` or ``scalar``. The API reference is generated from the same docstrings, so this is what a reader sees.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from collections.abc import Callable, Iterator

import pytest

import gpattn

# every public subpackage of gpattn (a new one must get an API page and documented names)
SUBPACKAGES = tuple(
    sorted(module.name for module in pkgutil.iter_modules(gpattn.__path__) if module.ispkg and module.name[0] != "_")
)
TENSOR = re.compile(r"\bTensor\b")
# a literal dimension tuple in double backticks, e.g. ``(B, H, N, s)``, ``(*batch, N)``, ``(n,)``, ``(n, C p^2)``
SHAPE_TUPLE = re.compile(r"``\([^()`]*,[^()`]*\)``")
SHAPE_WORD = re.compile(r"\b(shape|shapes|scalar)\b", re.IGNORECASE)
# methods that GPyTorch/torch call for the user and whose docstring would only repeat the class's
DUNDERS = ("__call__",)


def _public_objects() -> list[tuple[str, object]]:
    objects = []
    for name in SUBPACKAGES:
        module = importlib.import_module(f"gpattn.{name}")
        for member in module.__all__:
            objects.append((f"gpattn.{name}.{member}", getattr(module, member)))
    return objects


PUBLIC = _public_objects()
DOCUMENTED = [(path, obj) for path, obj in PUBLIC if inspect.isclass(obj) or inspect.isfunction(obj)]


def _annotations(function: Callable) -> list[str]:
    """The parameter and return annotations of ``function`` as text (``from __future__ import annotations`` keeps
    them as strings; others are formatted)."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return []
    annotations = [parameter.annotation for parameter in signature.parameters.values()]
    annotations.append(signature.return_annotation)
    return [
        annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
        for annotation in annotations
        if annotation is not inspect.Parameter.empty
    ]


def handles_tensors(function: Callable) -> bool:
    """Whether an annotation of a parameter or of the return value names ``Tensor``."""
    return any(TENSOR.search(annotation) for annotation in _annotations(function))


def states_shape(docstring: str) -> bool:
    """Whether a docstring states a shape (see the module docstring for the rule)."""
    return bool(SHAPE_TUPLE.search(docstring) or SHAPE_WORD.search(docstring))


def _defined_in_gpattn(value: object) -> bool:
    function = value.fget if isinstance(value, property) else value
    function = getattr(function, "__func__", function)  # staticmethod / classmethod
    return inspect.isfunction(function) and function.__module__.startswith("gpattn")


def _members(cls: type) -> Iterator[tuple[str, Callable, bool]]:
    """``(name, function, is_property)`` of the public methods and properties of ``cls`` defined in gpattn, each
    once (the most derived definition)."""
    seen = set()
    for klass in cls.__mro__:
        for name, value in vars(klass).items():
            if name in seen or (name.startswith("_") and name not in DUNDERS):
                continue
            seen.add(name)
            if _defined_in_gpattn(value):
                function = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
                yield name, function, isinstance(value, property)


def _docstring(cls: type, name: str) -> str:
    return inspect.getdoc(getattr(cls, name)) or ""


METHODS = [
    (f"{path}.{name}", obj, name, function, is_property)
    for path, obj in DOCUMENTED
    if inspect.isclass(obj)
    for name, function, is_property in _members(obj)
]


def test_every_subpackage_exports_names() -> None:
    for name in SUBPACKAGES:
        assert importlib.import_module(f"gpattn.{name}").__all__, f"gpattn.{name} has an empty __all__"
    assert len(DOCUMENTED) >= 80, f"expected at least 80 public classes and functions, found {len(DOCUMENTED)}"


@pytest.mark.parametrize(("path", "obj"), DOCUMENTED, ids=[path for path, _ in DOCUMENTED])
def test_public_name_has_docstring(path: str, obj: object) -> None:
    docstring = obj.__doc__ or ""
    if inspect.isclass(obj) and docstring.startswith(f"{obj.__name__}("):
        docstring = ""  # the signature that dataclasses and NamedTuples put in place of a missing docstring
    assert docstring.strip(), f"{path} has no docstring"


def _signature_owner(obj: object) -> Callable:
    """The callable whose signature a public name's docstring documents: ``__init__`` for a class."""
    return obj.__init__ if inspect.isclass(obj) else obj


TENSOR_CALLABLES = [
    (path, obj)
    for path, obj in DOCUMENTED
    if _defined_in_gpattn(_signature_owner(obj)) and handles_tensors(_signature_owner(obj))
]


@pytest.mark.parametrize(("path", "obj"), TENSOR_CALLABLES, ids=[path for path, _ in TENSOR_CALLABLES])
def test_tensor_signature_states_shapes(path: str, obj: object) -> None:
    assert states_shape(inspect.getdoc(obj) or ""), f"{path} takes or returns tensors but its docstring states no shape"


@pytest.mark.parametrize(
    ("path", "cls", "name", "function", "is_property"), METHODS, ids=[method[0] for method in METHODS]
)
def test_public_method_is_documented(path: str, cls: type, name: str, function: Callable, is_property: bool) -> None:
    docstring = _docstring(cls, name)
    assert docstring.strip(), f"{path} has no docstring (neither its own nor an overridden gpattn method's)"
    if handles_tensors(function):
        assert states_shape(docstring), f"{path} takes or returns tensors but its docstring states no shape"


def test_the_rules_catch_what_they_should() -> None:
    def undocumented(x: Tensor) -> Tensor:  # noqa: F821 (the annotation is only read as text)
        return x

    def documented(x: Tensor) -> Tensor:  # noqa: F821
        """:param x: shape ``(B, N, C)``. :return: ``(B, N, C)``."""
        return x

    assert handles_tensors(undocumented) and not states_shape(inspect.getdoc(undocumented) or "")
    assert states_shape(inspect.getdoc(documented))
    assert states_shape("the KL, a scalar") and states_shape("``(n,)``") and states_shape("``(*batch, N, s)``")
    assert not states_shape(r":math:`\kappa(x, z)` between queries and keys")
    assert not handles_tensors(lambda n, seed=0: n)
