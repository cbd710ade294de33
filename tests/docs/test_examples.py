"""The ``Example:`` blocks of the library's docstrings run as written and print what they show (doctest).

Every module of the listed subpackages is searched for docstring examples (``>>>`` lines), which run in the module's
namespace with doctest's ``ELLIPSIS`` and ``NORMALIZE_WHITESPACE`` options. An example that prints values sets its own
seed, so that a user who copies it sees the same numbers.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

# the subpackages whose examples are doctests (gpattn.experiments only re-exports names of gpattn.training and
# gpattn.comparison)
PACKAGES = (
    "attention",
    "comparison",
    "data",
    "features",
    "integrations",
    "kernels",
    "ksvd",
    "methods",
    "metrics",
    "mlls",
    "models",
    "plotting",
    "test",
    "training",
    "variational",
)
OPTIONS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _examples() -> list[doctest.DocTest]:
    finder = doctest.DocTestFinder(exclude_empty=True)
    found = []
    for package in PACKAGES:
        root = importlib.import_module(f"gpattn.{package}")
        names = [root.__name__] + [info.name for info in pkgutil.walk_packages(root.__path__, f"{root.__name__}.")]
        for name in names:
            module = importlib.import_module(name)
            found.extend(test for test in finder.find(module, name) if test.examples)
    return sorted(found, key=lambda test: test.name)


EXAMPLES = _examples()
# the docstrings that must carry an example (issue 22): the KEP layer, both strategies, the feature classes, the pair
# SVGP model and the readout
REQUIRED = (
    "gpattn.attention.kep_svgp_attention.KEPSVGPAttention",
    "gpattn.variational.kernel_eigen_variational_strategy.KernelEigenVariationalStrategy",
    "gpattn.variational.kernel_eigen_pair_variational_strategy.KernelEigenPairVariationalStrategy",
    "gpattn.variational.kernel_eigen_readout.KernelEigenReadout",
    "gpattn.features.kernel_eigen_features.KernelEigenFeatures",
    "gpattn.features.amortized_attention_features.AmortizedAttentionFeatures",
    "gpattn.features.primal_tokens_attention_features.PrimalTokensAttentionFeatures",
    "gpattn.features.primal_features_attention_features.PrimalFeaturesAttentionFeatures",
    "gpattn.features.exact_attention_features.ExactAttentionFeatures",
    "gpattn.models.kernel_eigen_pair_svgp.KernelEigenPairSVGP",
)


def test_the_required_docstrings_have_examples():
    names = {test.name for test in EXAMPLES}
    assert [name for name in REQUIRED if name not in names] == []


@pytest.mark.parametrize("example", EXAMPLES, ids=[test.name for test in EXAMPLES])
def test_docstring_example(example: doctest.DocTest):
    runner = doctest.DocTestRunner(optionflags=OPTIONS)
    report: list[str] = []
    result = runner.run(example, out=report.append, clear_globs=True)
    assert result.failed == 0, "".join(report)
