"""Comparison rows as data: a row of ``gpattn compare`` is a :class:`MethodSpec` (a registered attention and its
arguments, a :class:`TrainingRecipe`, a :class:`Predictive`, whether a temperature-scaled row is added), registered by
name like the attentions (:func:`register_method`, :func:`get_method`), and each run reads its numbers from
:class:`Hyperparameters`.

This package depends on the attention registry only; the comparison (:mod:`gpattn.comparison`) resolves every row
through it once.
"""

from .hyperparameters import Hyperparameters
from .method_spec import MethodSpec
from .predictive import PREDICTIVE_KINDS, Predictive
from .recipe import TrainingRecipe
from .registry import METHODS, get_method, method_names, register_method, resolve_method, unregister_method

__all__ = [
    "METHODS",
    "PREDICTIVE_KINDS",
    "Hyperparameters",
    "MethodSpec",
    "Predictive",
    "TrainingRecipe",
    "get_method",
    "method_names",
    "register_method",
    "resolve_method",
    "unregister_method",
]
