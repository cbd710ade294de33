"""Property tests (hypothesis): ``kernel_svd`` over shapes, ranks, batch shapes, dtypes and spectra; the closed-form
KL of the kernel-eigen strategy and of KEP-SVGP attention against ``torch.distributions``; mask, truncation,
permutation and causal invariances of every registered attention.

Profile ``gpattn-reliability``: derandomised (the same examples on every run and machine, no example database),
no deadline, ``GPATTN_HYPOTHESIS_EXAMPLES`` examples per property (default 100; raise it for a deeper local search).
Run with ``--hypothesis-show-statistics`` to see how many examples each property ran.
"""

from __future__ import annotations

import os

import gpytorch
import numpy as np
import pytest
import torch
from gpytorch.variational import CholeskyVariationalDistribution, MeanFieldVariationalDistribution
from hypothesis import HealthCheck, Phase, assume, given, note, settings
from hypothesis import strategies as st
from torch import Tensor

from gpattn.attention import ATTENTIONS, KEPSVGPAttention, attention_arguments, attention_names, build_attention
from gpattn.kernels import CosineFeatureKernel
from gpattn.ksvd import kernel_svd
from gpattn.variational import KernelEigenVariationalStrategy

settings.register_profile(
    "gpattn-reliability",
    # no explain phase: on a failure it reruns the test hundreds of times to annotate the report
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    max_examples=int(os.environ.get("GPATTN_HYPOTHESIS_EXAMPLES", "100")),
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    # the module's autouse one-thread fixture does not need resetting between examples
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)
PROFILE = settings.get_profile("gpattn-reliability")

DTYPE = torch.float64
NAMES = attention_names()
#: the registry rows whose defaults read token positions (the papers' per-position parametrisation
#: features="primal_tokens"/"primal_features", or merge="concat_tokens"): padding is invisible to them, but a
#: sequence's outputs depend on where its tokens sit and on its padded length (the position rows of W~), so the
#: permutation, unpadded-equality and causal properties below do not apply
POSITIONAL = [
    name
    for name in NAMES
    if ATTENTIONS[name][1].get("features") in ("primal_tokens", "primal_features")
    or ATTENTIONS[name][1].get("merge") == "concat_tokens"
]
SIZE_ARGUMENTS = ("num_inducing",)
seeds = st.integers(0, 2**31 - 1)


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -- kernel_svd ------------------------------------------------------------------------------------------------------
@st.composite
def svd_problems(draw):
    """A (batched) matrix of one of several spectral kinds, a rank and a method."""
    batch = draw(st.sampled_from([(), (1,), (3,), (2, 2)]))
    num_rows, num_cols = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    size = min(num_rows, num_cols)
    rank = draw(st.integers(1, size))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    kind = draw(st.sampled_from(["gaussian", "low_rank", "repeated", "zero_rows"]))
    scale = draw(st.sampled_from([1e-3, 1.0, 1e3]))
    method = draw(st.sampled_from(["exact", "exact", "randomized"]))
    generator = _generator(draw(seeds))
    shape = (*batch, num_rows, num_cols)
    if kind == "low_rank":
        inner = draw(st.integers(1, size))
        matrix = torch.randn(*batch, num_rows, inner, generator=generator, dtype=DTYPE) @ torch.randn(
            *batch, inner, num_cols, generator=generator, dtype=DTYPE
        )
    elif kind == "repeated":
        values = torch.tensor(draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0]), min_size=size, max_size=size)))
        left = torch.linalg.qr(torch.randn(*batch, num_rows, size, generator=generator, dtype=DTYPE)).Q
        right = torch.linalg.qr(torch.randn(*batch, num_cols, size, generator=generator, dtype=DTYPE)).Q
        matrix = (left * values.to(DTYPE)) @ right.mT
    else:
        matrix = torch.randn(*shape, generator=generator, dtype=DTYPE)
        if kind == "zero_rows":  # padding
            matrix[..., draw(st.integers(0, num_rows - 1)) :, :] = 0.0
    note(f"kind={kind} shape={shape} rank={rank} dtype={dtype} scale={scale} method={method}")
    return (scale * matrix).to(dtype), rank, method


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-10 if dtype == torch.float64 else 2e-4


@PROFILE
@given(svd_problems())
def test_kernel_svd_properties(problem):
    matrix, rank, method = problem
    svd = kernel_svd(matrix, rank, method=method)
    *batch, num_rows, num_cols = matrix.shape
    assert svd.left.shape == (*batch, num_rows, rank) and svd.right.shape == (*batch, num_cols, rank)
    assert svd.singular_values.shape == (*batch, rank)
    assert all(part.dtype == matrix.dtype for part in svd)
    values = svd.singular_values
    tol = _tolerance(matrix.dtype)
    reference = np.linalg.svd(matrix.double().numpy(), compute_uv=False)  # shape: (*batch, min(N, M))
    largest = max(float(reference.max(initial=0.0)), 1e-300)
    # sorted, non-negative, finite
    assert torch.isfinite(values).all() and (values >= 0).all()
    assert (values[..., :-1] >= values[..., 1:]).all()
    # orthonormal columns
    eye = torch.eye(rank, dtype=matrix.dtype)
    torch.testing.assert_close(svd.left.mT @ svd.left, eye.expand(*batch, rank, rank), atol=10 * tol, rtol=0)
    torch.testing.assert_close(svd.right.mT @ svd.right, eye.expand(*batch, rank, rank), atol=10 * tol, rtol=0)
    # sign rule: the largest-magnitude entry of every left vector is positive (its maximum is at least -its minimum)
    assert (svd.left.amax(dim=-2) >= -svd.left.amin(dim=-2) - tol).all()
    # the computed triplets are consistent: K H_r = H_e Lambda
    scaled_left = svd.left * values.unsqueeze(-2)
    torch.testing.assert_close(matrix @ svd.right, scaled_left, atol=10 * tol * largest, rtol=0)
    if method == "exact":
        # singular values and the rank-s truncation error against numpy (Eckart-Young: unique even when the
        # truncated subspace is not)
        np.testing.assert_allclose(values.double().numpy(), reference[..., :rank], atol=10 * tol * largest, rtol=0)
        residual = matrix.double() - (scaled_left @ svd.right.mT).double()
        discarded = (reference[..., rank:] ** 2).sum(-1)
        np.testing.assert_allclose(
            residual.square().sum((-2, -1)).numpy(), discarded, atol=100 * tol * largest**2, rtol=0
        )
        # the truncation itself equals numpy's where it is unique (a gap at the cut)
        if rank < reference.shape[-1] and (reference[..., rank - 1] - reference[..., rank]).min() > 1e-2 * largest:
            u, s, vh = np.linalg.svd(matrix.double().numpy(), full_matrices=False)
            expected = (u[..., :rank] * s[..., None, :rank]) @ vh[..., :rank, :]
            truncation = (scaled_left @ svd.right.mT).double().numpy()
            np.testing.assert_allclose(truncation, expected, atol=1e3 * tol * largest, rtol=0)
    else:  # the randomised values never exceed the exact ones
        assert (values.double().numpy() <= reference[..., :rank] + 10 * tol * largest).all()
    # deterministic, and differentiable with finite gradients whatever the spectrum
    again = kernel_svd(matrix, rank, method=method)
    assert all(torch.equal(a, b) for a, b in zip(svd, again, strict=True))
    matrix = matrix.clone().requires_grad_(True)
    weights = [torch.randn(part.shape, generator=_generator(0), dtype=part.dtype) for part in svd]
    outputs = kernel_svd(matrix, rank, method=method)
    sum((part * weight).sum() for part, weight in zip(outputs, weights, strict=True)).backward()
    assert torch.isfinite(matrix.grad).all()


# -- the kernel-eigen strategy and KEP-SVGP attention: closed-form KL ------------------------------------------------
class _Branch(gpytorch.models.ApproximateGP):
    def __init__(self, landmarks: Tensor, rank: int, distribution: type, batch_shape: torch.Size, whiten: bool):
        strategy = KernelEigenVariationalStrategy(
            self, landmarks, distribution(rank, batch_shape=batch_shape), residual="none", whiten=whiten
        )
        super().__init__(strategy)
        self.covar_module = CosineFeatureKernel(2, feature_dim=8, lift="rff", lift_dim=16, seed=3)

    def forward(self, x):
        raise NotImplementedError


def _random_tril(shape: tuple[int, ...], generator: torch.Generator) -> Tensor:
    raw = torch.randn(*shape, generator=generator, dtype=DTYPE).tril(-1)
    diagonal = 0.2 + torch.rand(*shape[:-1], generator=generator, dtype=DTYPE)
    return raw + torch.diag_embed(diagonal)


@PROFILE
@given(
    rank=st.integers(1, 6),
    extra_landmarks=st.integers(0, 4),
    batch=st.sampled_from([(), (2,), (2, 3)]),
    distribution=st.sampled_from([CholeskyVariationalDistribution, MeanFieldVariationalDistribution]),
    whiten=st.booleans(),
    seed=seeds,
)
def test_strategy_kl_equals_torch_distributions(rank, extra_landmarks, batch, distribution, whiten, seed):
    generator = _generator(seed)
    landmarks = torch.randn(rank + extra_landmarks, 2, generator=generator, dtype=DTYPE)
    torch.manual_seed(seed % 1000)
    model = _Branch(landmarks, rank, distribution, torch.Size(batch), whiten).double()
    strategy = model.variational_strategy
    q = strategy._variational_distribution
    mean = torch.randn(*batch, rank, generator=generator, dtype=DTYPE)
    with torch.no_grad():
        q.variational_mean.copy_(mean)
        if distribution is CholeskyVariationalDistribution:
            chol = _random_tril((*batch, rank, rank), generator)
            q.chol_variational_covar.copy_(chol)
        else:
            std = 0.2 + torch.rand(*batch, rank, generator=generator, dtype=DTYPE)
            q._variational_stddev.copy_(std)
            chol = torch.diag_embed(std)
    strategy.variational_params_initialized.fill_(1)
    strategy._clear_cache()  # q(u) is memoised between calls of the model (which clear it in training mode)
    singular_values = strategy.features.singular_values.detach()
    assume(bool(singular_values.min() > 1e-6 * singular_values.max()))  # a non-degenerate prior N(0, Lambda^2)
    prior_variance = torch.ones_like(singular_values) if whiten else singular_values.square()
    prior = torch.distributions.MultivariateNormal(torch.zeros(rank, dtype=DTYPE), torch.diag(prior_variance))
    expected = torch.distributions.kl_divergence(torch.distributions.MultivariateNormal(mean, scale_tril=chol), prior)
    torch.testing.assert_close(strategy.kl_divergence().detach(), expected, atol=1e-9, rtol=1e-9)
    # q = p: KL 0
    with torch.no_grad():
        q.variational_mean.zero_()
        root = prior_variance.sqrt().expand(*batch, rank)
        if distribution is CholeskyVariationalDistribution:
            q.chol_variational_covar.copy_(torch.diag_embed(root))
        else:
            q._variational_stddev.copy_(root)
    strategy._clear_cache()
    assert strategy.kl_divergence().abs().max() < 1e-10


def _posteriors(layer: KEPSVGPAttention) -> list[tuple[Tensor, Tensor]]:
    """Views (m, L) into the layer's stacked q(u), one per q(u) the layer holds (branches; one shared or tied)."""
    q = layer.strategy._variational_distribution
    if layer.tie_qk:
        return [(q.variational_mean, q.chol_variational_covar)]
    branches = q.variational_mean.shape[-2]
    return [(q.variational_mean[..., i, :], q.chol_variational_covar[..., i, :, :]) for i in range(branches)]


@PROFILE
@given(
    rank=st.integers(1, 4),
    num_heads=st.sampled_from([1, 2]),
    num_outputs=st.integers(1, 3),
    options=st.sampled_from([{}, {"tie_qk": True}, {"shared_posterior": True}, {"merge": "concat"}]),
    seed=seeds,
)
def test_kep_attention_kl_equals_torch_distributions(rank, num_heads, num_outputs, options, seed):
    torch.manual_seed(seed % 1000)
    layer = KEPSVGPAttention(8, num_heads, num_inducing=rank, num_outputs=num_outputs, **options).double()
    generator = _generator(seed)
    expected = torch.zeros((), dtype=DTYPE)
    singular_values = layer.features.singular_values.detach()  # (H, s)
    prior = torch.distributions.MultivariateNormal(
        torch.zeros(num_heads, 1, rank, dtype=DTYPE), torch.diag_embed(singular_values.square()).unsqueeze(1)
    )
    for mean_parameter, chol_parameter in _posteriors(layer):
        mean = torch.randn(num_heads, num_outputs, rank, generator=generator, dtype=DTYPE)
        chol = _random_tril((num_heads, num_outputs, rank, rank), generator)
        with torch.no_grad():
            mean_parameter.copy_(mean)
            chol_parameter.copy_(chol)
        q = torch.distributions.MultivariateNormal(mean, scale_tril=chol)
        expected = expected + torch.distributions.kl_divergence(q, prior).sum()
    torch.testing.assert_close(layer.kl_divergence().detach(), expected, atol=1e-9, rtol=1e-9)
    # q = p for every branch, head and output: KL 0
    with torch.no_grad():
        for mean_parameter, chol_parameter in _posteriors(layer):
            mean_parameter.zero_()
            chol_parameter.copy_(torch.diag_embed(singular_values).unsqueeze(1).expand_as(chol))
    assert layer.kl_divergence().abs() < 1e-10


# -- attention invariances -------------------------------------------------------------------------------------------
_LAYERS: dict[str, torch.nn.Module] = {}


def _layer(name: str):
    """One small float64 layer per registered attention, in eval mode (deterministic: the predictive mean)."""
    if name not in _LAYERS:
        torch.manual_seed(0)
        sizes = {key: 4 for key in SIZE_ARGUMENTS if key in attention_arguments(name)}
        _LAYERS[name] = build_attention(name, 8, 2, **sizes).double().eval()
    return _LAYERS[name]


@st.composite
def padded_batches(draw):
    """Tokens ``(B, N, 8)``, per-sequence lengths (padding at the end) and a padding mask."""
    batch, length = draw(st.integers(1, 3)), draw(st.integers(2, 7))
    lengths = draw(st.lists(st.integers(1, length), min_size=batch, max_size=batch))
    generator = _generator(draw(seeds))
    tokens = torch.randn(batch, length, 8, generator=generator, dtype=DTYPE)
    mask = torch.arange(length) < torch.tensor(lengths)[:, None]
    return tokens, lengths, mask, generator


ATOL = 1e-10


@PROFILE
@given(name=st.sampled_from(NAMES), data=padded_batches())
def test_padding_is_invisible(name, data):
    tokens, lengths, mask, generator = data
    layer = _layer(name)
    output = layer(tokens, mask=mask)
    # (1) whatever the padded tokens hold, the real outputs do not change
    garbage = torch.where(mask.unsqueeze(-1), tokens, 1e3 * torch.randn(tokens.shape, generator=generator, dtype=DTYPE))
    changed = layer(garbage, mask=mask)
    for index, length in enumerate(lengths):
        torch.testing.assert_close(changed[index, :length], output[index, :length], atol=ATOL, rtol=0)
        if name in POSITIONAL:
            continue
        # (2) and they equal the outputs of the unpadded sequence alone (no other sequence of the batch matters)
        alone = layer(tokens[index : index + 1, :length])
        torch.testing.assert_close(output[index, :length], alone[0], atol=ATOL, rtol=0)


@PROFILE
@given(name=st.sampled_from([name for name in NAMES if name not in POSITIONAL]), data=padded_batches(), seed=seeds)
def test_permuting_real_tokens_permutes_the_outputs(name, data, seed):
    # every registered layer (default settings) sees no positions: permutation equivariant over the real tokens.
    # Not true of the fixed-length parametrisations (features="primal_tokens", merge="concat_tokens") or causal masks.
    tokens, lengths, mask, _ = data
    layer = _layer(name)
    generator = _generator(seed)
    order = torch.arange(tokens.shape[1]).repeat(tokens.shape[0], 1)
    for index, length in enumerate(lengths):
        order[index, :length] = torch.randperm(length, generator=generator)
    permuted = torch.gather(tokens, 1, order.unsqueeze(-1).expand_as(tokens))
    output, permuted_output = layer(tokens, mask=mask), layer(permuted, mask=mask)
    expected = torch.gather(output, 1, order.unsqueeze(-1).expand_as(output))
    for index, length in enumerate(lengths):
        torch.testing.assert_close(permuted_output[index, :length], expected[index, :length], atol=ATOL, rtol=0)


CAUSAL = [name for name in NAMES if ATTENTIONS[name][0].supports_causal and name not in POSITIONAL]


@PROFILE
@given(name=st.sampled_from(CAUSAL), data=padded_batches(), position=st.integers(0, 5))
def test_causal_outputs_ignore_the_future(name, data, position):
    tokens, _, _, generator = data
    cut = 1 + position % (tokens.shape[1] - 1)  # 1 <= cut < N
    layer = _layer(name)
    future = tokens.clone()
    future[:, cut:] = 1e2 * torch.randn(future[:, cut:].shape, generator=generator, dtype=DTYPE)
    output, changed = layer(tokens, mask="causal"), layer(future, mask="causal")
    torch.testing.assert_close(changed[:, :cut], output[:, :cut], atol=ATOL, rtol=0)
    # and the prefix alone gives the same outputs
    torch.testing.assert_close(layer(tokens[:, :cut], mask="causal"), output[:, :cut], atol=ATOL, rtol=0)


def test_profile_is_deterministic():
    assert PROFILE.derandomize and PROFILE.database is None and PROFILE.deadline is None


@pytest.mark.parametrize("name", NAMES)
def test_every_registered_attention_is_covered(name):
    assert _layer(name).embed_dim == 8
