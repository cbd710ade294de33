"""The attention-side kernel-eigen features at their edges: :func:`~gpattn.ksvd.kernel_svd` against a dense NumPy SVD
in float64 (one token, ``s = N``, a zero matrix, rank below ``s``, broadcast batches, the randomised method against
the Eckart-Young optimum), the stationarity of the KSVD objective at the exact solution, gradients through padded and
rank-deficient kernels (gradcheck), padding that must not change the real tokens' features, :math:`J` or the
parameters' gradients in any mode, the kernel diagonals against the dense kernel, :func:`ksvd_fidelity` against
SciPy's principal angles, the KSVD penalty of a call, and the official KSVD objective of per-output scores.

A test marked ``xfail(strict=True)`` records a defect: it asserts the right behaviour and fails until the defect is
fixed (then the strict marker makes it fail, so that the marker is removed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.linalg import subspace_angles
from torch import Tensor

from gpattn.features import build_attention_features
from gpattn.features.ksvd_fidelity import ksvd_fidelity
from gpattn.ksvd import kernel_svd, ksvd_objective

DTYPE = torch.float64


# -- helpers -----------------------------------------------------------------------------------------------------------
def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _features(mode: str, seed: int = 0, **kwargs):
    torch.manual_seed(seed)
    return build_attention_features(16, 2, 3, mode=mode, **kwargs).to(DTYPE)


def _call_inputs(call: str, seed: int, lengths: tuple[int, int], row: int, cut: int):
    """Queries ``(2, N, 16)``, keys ``(2, M, 16)`` for a ``cross`` call (else ``None``), the tokens the keys are
    (``other``) and, for a ``padded`` call, a mask hiding the tokens of ``row`` from ``cut`` on."""
    generator = _generator(seed)
    queries = torch.randn(2, lengths[0], 16, generator=generator, dtype=DTYPE)
    keys = torch.randn(2, lengths[1], 16, generator=generator, dtype=DTYPE) if call.startswith("cross") else None
    other = queries if keys is None else keys
    mask = None
    if call.endswith("padded"):
        mask = torch.ones(2, other.shape[1], dtype=torch.bool)
        mask[row, cut:] = False
    return queries, keys, other, mask


def _assert_matches_numpy(matrix: Tensor, rank: int, method: str) -> None:
    """``kernel_svd`` against ``numpy.linalg.svd``: values, the pairs up to one sign per pair (only for values that
    are separated and numerically nonzero), orthonormal columns and the adjoint relations ``K H_r = H_e Lambda``,
    ``K^T H_e = H_r Lambda`` for every kept pair (also the numerically zero ones)."""
    svd = kernel_svd(matrix, rank, method=method)
    left, values, right_h = np.linalg.svd(matrix.numpy(), full_matrices=False)
    np.testing.assert_allclose(svd.singular_values.numpy(), values[:rank], atol=1e-12 * max(values[0], 1.0))
    identity = torch.eye(rank, dtype=DTYPE)
    torch.testing.assert_close(svd.left.mT @ svd.left, identity, atol=1e-12, rtol=0)
    torch.testing.assert_close(svd.right.mT @ svd.right, identity, atol=1e-12, rtol=0)
    scaled = svd.singular_values.unsqueeze(-2)
    torch.testing.assert_close(matrix @ svd.right, svd.left * scaled, atol=1e-12, rtol=0)
    torch.testing.assert_close(matrix.mT @ svd.left, svd.right * scaled, atol=1e-12, rtol=0)
    floor = max(matrix.shape) * np.finfo(np.float64).eps * max(values[0], 1e-300)
    for k in range(rank):
        gaps = np.abs(values[k] - np.delete(values, k))
        if values[k] > 1e3 * floor and (gaps.size == 0 or gaps.min() > 1e-6):
            sign = np.sign(left[:, k] @ svd.left[:, k].numpy())
            np.testing.assert_allclose(svd.left[:, k].numpy(), sign * left[:, k], atol=1e-10)
            np.testing.assert_allclose(svd.right[:, k].numpy(), sign * right_h[k], atol=1e-10)


def _random_projection(svd, seed: int) -> Tensor:
    generator = _generator(seed)
    return sum((part * torch.randn(part.shape, generator=generator, dtype=part.dtype)).sum() for part in svd)


# -- kernel_svd against the dense SVD at its edges -------------------------------------------------------------------
def _low_rank(num_rows: int, num_cols: int, rank: int, seed: int) -> Tensor:
    generator = _generator(seed)
    factors = [torch.randn(size, rank, generator=generator, dtype=DTYPE) for size in (num_rows, num_cols)]
    return factors[0] @ factors[1].T


EDGES = {  # name -> (matrix, rank)
    "one_token": (torch.tensor([[1.7]], dtype=DTYPE), 1),
    "one_query": (torch.randn(1, 6, generator=_generator(1), dtype=DTYPE), 1),
    "one_key": (torch.randn(6, 1, generator=_generator(2), dtype=DTYPE), 1),
    "s_equals_n": (torch.randn(5, 5, generator=_generator(3), dtype=DTYPE), 5),
    "s_equals_m_wide": (torch.randn(4, 7, generator=_generator(4), dtype=DTYPE), 4),
    "zero": (torch.zeros(4, 3, dtype=DTYPE), 2),
    "rank_below_s": (_low_rank(8, 6, 2, seed=5), 4),
    "constant": (torch.full((5, 4), 0.3, dtype=DTYPE), 3),
}


@pytest.mark.parametrize("method", ["exact", "randomized"])
@pytest.mark.parametrize("name", list(EDGES))
def test_kernel_svd_edges_against_numpy(name: str, method: str) -> None:
    matrix, rank = EDGES[name]
    _assert_matches_numpy(matrix, rank, method)


@pytest.mark.parametrize("method", ["exact", "randomized"])
def test_a_broadcast_batch_is_the_unbatched_decomposition_and_sums_its_gradient(method: str) -> None:
    """An expanded (stride-0) batch gives every copy the unbatched triplets, and the gradient of the shared matrix is
    the sum over the copies."""
    matrix = torch.randn(7, 5, generator=_generator(6), dtype=DTYPE, requires_grad=True)
    batched = kernel_svd(matrix.expand(3, 7, 5), 2, method=method)
    single = kernel_svd(matrix, 2, method=method)
    for part, reference in zip(batched, single, strict=True):
        torch.testing.assert_close(part, reference.expand_as(part), atol=1e-12, rtol=0)
    (gradient,) = torch.autograd.grad(_random_projection([part[1] for part in batched], 7), matrix)
    (copy_gradient,) = torch.autograd.grad(_random_projection(single, 7), matrix)
    torch.testing.assert_close(gradient, copy_gradient, atol=1e-12, rtol=0)


@pytest.mark.parametrize(("decay", "tolerance"), [(1.0, 1e-6), (0.5, 1e-3)], ids=["one-over-i", "one-over-sqrt-i"])
def test_randomized_defaults_reach_the_eckart_young_optimum_on_slow_spectra(decay: float, tolerance: float) -> None:
    """With its defaults (oversampling 10, 4 power iterations) the randomised method's rank-5 approximation of a
    60 x 50 matrix with the slowly decaying spectrum i^-decay has the optimal spectral error sigma_6 (Eckart-Young,
    within 1e-3) and singular values within ``tolerance`` of the exact ones (observed 3e-10 and 1e-5)."""
    generator = _generator(8)
    left = torch.linalg.qr(torch.randn(60, 50, generator=generator, dtype=DTYPE)).Q
    right = torch.linalg.qr(torch.randn(50, 50, generator=generator, dtype=DTYPE)).Q
    values = torch.arange(1, 51, dtype=DTYPE) ** -decay
    matrix = left * values @ right.T
    svd = kernel_svd(matrix, 5, method="randomized", seed=3)
    error = torch.linalg.matrix_norm(matrix - svd.left * svd.singular_values @ svd.right.T, ord=2)
    assert values[5] <= error <= 1.001 * values[5]
    torch.testing.assert_close(svd.singular_values, values[:5], rtol=tolerance, atol=0)


# -- the KSVD objective at the exact solution --------------------------------------------------------------------------
def test_the_exact_ksvd_is_a_stationary_point_of_the_primal_objective() -> None:
    """At W_e = Phi_k^T H_r, W_r = Phi_q^T H_e (e = Phi_q W_e, r = Phi_k W_r): J = 0, dJ/dW_e = Phi_q^T e Lambda^-1 -
    W_r = 0, dJ/dW_r = 0, and dJ/dlambda_k = -(sum_i e_ik^2 + sum_j r_jk^2) / (2 lambda_k^2) = -1 (closed forms)."""
    generator = _generator(9)
    query_features = torch.nn.functional.normalize(torch.randn(7, 4, generator=generator, dtype=DTYPE), dim=-1)
    key_features = torch.nn.functional.normalize(torch.randn(6, 4, generator=generator, dtype=DTYPE), dim=-1)
    svd = kernel_svd(query_features @ key_features.T, 3)
    left_weights = (key_features.T @ svd.right).requires_grad_(True)
    right_weights = (query_features.T @ svd.left).requires_grad_(True)
    singular_values = svd.singular_values.clone().requires_grad_(True)
    objective = ksvd_objective(
        query_features @ left_weights, key_features @ right_weights, left_weights, right_weights, singular_values
    )
    assert abs(objective.item()) < 1e-13
    gradients = torch.autograd.grad(objective, [left_weights, right_weights, singular_values])
    torch.testing.assert_close(gradients[0], torch.zeros_like(gradients[0]), atol=1e-13, rtol=0)
    torch.testing.assert_close(gradients[1], torch.zeros_like(gradients[1]), atol=1e-13, rtol=0)
    torch.testing.assert_close(gradients[2], torch.full_like(gradients[2], -1.0), atol=1e-12, rtol=0)


# -- gradients through kernels with exact zero singular values ---------------------------------------------------------
def _padded_kernel() -> Tensor:
    matrix = torch.randn(8, 8, generator=_generator(10), dtype=DTYPE)
    matrix[5:] = 0.0  # padded queries and keys, zeroed as the exact attention features zero them
    matrix[:, 6:] = 0.0
    return matrix


@pytest.mark.parametrize(
    ("matrix", "rank"),
    [(_padded_kernel(), 3), (_low_rank(7, 9, 3, seed=11), 2), (_low_rank(9, 7, 3, seed=12), 2)],
    ids=["padded", "rank-deficient-wide", "rank-deficient-tall"],
)
def test_the_kept_triplets_of_a_kernel_with_exact_zeros_are_differentiated_exactly(matrix: Tensor, rank: int) -> None:
    """Exact zero singular values outside the kept (separated, nonzero) ones do not bias the gradient: it is the
    derivative (gradcheck), not merely finite."""
    assert torch.autograd.gradcheck(
        lambda a: _random_projection(kernel_svd(a, rank), seed=13), (matrix.clone().requires_grad_(True),)
    )


def test_exact_attention_features_with_padding_pass_gradcheck() -> None:
    """The exact features of a padded sequence (their scores, Lambda and the kernel diagonal) are differentiated
    exactly with respect to the tokens, padded ones included (whose gradient is zero)."""
    torch.manual_seed(0)
    features = build_attention_features(8, 2, 2, mode="exact").to(DTYPE)
    tokens = torch.randn(1, 6, 8, generator=_generator(14), dtype=DTYPE)
    mask = torch.tensor([[True] * 4 + [False] * 2])
    probes = torch.randn(2, 1, 2, 6, 2, generator=_generator(15), dtype=DTYPE)

    def loss(x: Tensor) -> Tensor:
        scores = features(x, key_mask=mask)
        value = (scores.left_scores * probes[0]).sum() + (scores.right_scores * probes[1]).sum()
        return value + scores.singular_values.sum() + scores.left_kernel_diag.sum()

    inputs = tokens.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(loss, (inputs,))
    (gradient,) = torch.autograd.grad(loss(inputs), inputs)
    assert gradient[:, 4:].abs().max() == 0.0


def test_exact_attention_features_of_one_token_and_of_full_rank() -> None:
    """One token (s = N = 1) and s = N: e Lambda^-1 r^T reconstructs the dense kernel, every direction active."""
    for length in (1, 4):
        torch.manual_seed(0)
        features = build_attention_features(16, 2, length, mode="exact").to(DTYPE)
        tokens = torch.randn(2, length, 16, generator=_generator(16), dtype=DTYPE)
        scores = features(tokens)
        kernel = features.kernel.forward(tokens.unsqueeze(1), tokens.unsqueeze(1))
        approximation = (scores.left_scores / scores.singular_values.unsqueeze(-2)) @ scores.right_scores.mT
        torch.testing.assert_close(approximation, kernel, atol=1e-12, rtol=0)
        assert scores.active.all() and scores.singular_values.shape == (2, 2, length)


# -- padding is invisible to the real tokens -------------------------------------------------------------------------
PADDING_MODES = [
    ("amortized", {}),
    ("amortized", {"tie_qk": True}),
    ("primal_tokens", {"max_len": 8}),
    ("primal_tokens", {"max_len": 40, "rank_multiple": 1}),  # samples N' = s of the real tokens
    ("exact", {}),
    ("exact", {"kernel": "exponential"}),
]


@pytest.mark.parametrize("kernel_diag", [False, True], ids=["paired-path", "general-path"])
@pytest.mark.parametrize(("mode", "options"), PADDING_MODES, ids=lambda value: str(value))
def test_padding_changes_neither_the_features_nor_the_gradients_of_the_real_tokens(
    mode: str, options: dict, kernel_diag: bool
) -> None:
    """Three padded tokens of large magnitude behind five real ones: the real tokens' scores, Lambda, J, kernel
    diagonals and the gradients of every parameter and real token are those of the five tokens alone (to rounding),
    and the padded tokens get a zero gradient."""
    features = _features(mode, **options).train()
    generator = _generator(17)
    real = torch.randn(1, 5, 16, generator=generator, dtype=DTYPE)
    padded = torch.cat([real, 7.0 * torch.randn(1, 3, 16, generator=generator, dtype=DTYPE)], dim=1)
    mask = torch.tensor([[True] * 5 + [False] * 3])
    probes = torch.randn(2, 1, 2, 5, 3, generator=generator, dtype=DTYPE)

    def run(tokens: Tensor, key_mask: Tensor | None):
        tokens = tokens.clone().requires_grad_(True)
        scores = features(tokens, key_mask=key_mask, kernel_diag=kernel_diag)
        left, right = scores.left_scores[:, :, :5], scores.right_scores[:, :, :5]
        loss = (left * probes[0]).sum() + (right * probes[1]).sum() + scores.objective.square().sum()
        if kernel_diag:
            loss = loss + scores.left_kernel_diag[..., :5].sum() + scores.right_kernel_diag[..., :5].sum()
        parameters = [p for p in features.parameters() if p.requires_grad]
        gradients = torch.autograd.grad(loss, [tokens, *parameters], allow_unused=True)
        return (left, right, scores.singular_values, scores.objective), gradients

    alone, alone_gradients = run(real, None)
    with_padding, padded_gradients = run(padded, mask)
    for first, second in zip(alone, with_padding, strict=True):
        torch.testing.assert_close(second, first, atol=1e-13, rtol=1e-12)
    torch.testing.assert_close(padded_gradients[0][:, :5], alone_gradients[0], atol=1e-12, rtol=1e-12)
    assert padded_gradients[0][:, 5:].abs().max() == 0.0
    for first, second in zip(alone_gradients[1:], padded_gradients[1:], strict=True):
        assert (first is None) == (second is None)
        if first is not None:
            torch.testing.assert_close(second, first, atol=1e-12, rtol=1e-12)


# -- kernel diagonals against the dense kernel -------------------------------------------------------------------------
@pytest.mark.parametrize("call", ["self", "self-padded", "cross", "cross-padded", "causal"])
def test_learned_kernel_diagonals_are_the_dense_row_and_column_sums(call: str) -> None:
    """k_e(x_i) = sum_j kappa(x_i, z_j)^2 over the visible keys and k_r(z_j) = sum_i kappa(x_i, z_j)^2 over the
    visible queries, against the dense kernel with a non-unit output scale per head; causal: the prefixes the causal
    scores use (queries j <= i for e_i, and i <= j for r_j)."""
    features = _features("amortized")
    with torch.no_grad():
        features.kernel.outputscale = torch.tensor([1.3, 0.7], dtype=DTYPE)
    queries, keys, other, mask = _call_inputs(call, 18, (6, 5), row=0, cut=3)
    scores = features(queries, keys, mask, causal=call == "causal")
    kernel = features.kernel.forward(queries.unsqueeze(1), other.unsqueeze(1)).detach()
    rows = torch.ones(2, 1, 6, dtype=torch.bool)
    columns = torch.ones(2, 1, other.shape[1], dtype=torch.bool)
    left_kernel = right_kernel = kernel
    if mask is not None:
        left_kernel = right_kernel = kernel = kernel * mask[:, None, None, :]
        columns = mask[:, None, :]
        if keys is None:
            left_kernel = right_kernel = kernel * mask[:, None, :, None]
            rows = mask[:, None, :]
    if call == "causal":
        left_kernel, right_kernel = kernel.tril(), kernel.triu()
    left_expected, right_expected = left_kernel.square().sum(-1), right_kernel.square().sum(-2)
    left_got, right_got = scores.left_kernel_diag.detach(), scores.right_kernel_diag.detach()
    torch.testing.assert_close(left_got[rows.expand_as(left_got)], left_expected[rows.expand_as(left_got)])
    torch.testing.assert_close(right_got[columns.expand_as(right_got)], right_expected[columns.expand_as(right_got)])


# -- ksvd_fidelity against SciPy's principal angles ----------------------------------------------------------------
@pytest.mark.parametrize("call", ["self", "self-padded", "cross", "cross-padded"])
def test_fidelity_measures_against_scipy_and_numpy(call: str) -> None:
    """Every measure that has a direct definition (angles by ``scipy.linalg.subspace_angles``, errors, energy and
    effective rank by ``numpy.linalg.svd``, the relative objective from the scores) on the real tokens of every
    sequence and head of an amortised layer."""
    features = _features("amortized")
    queries, keys, other, mask = _call_inputs(call, 19, (8, 7), row=1, cut=5)
    fidelity = ksvd_fidelity(features, queries, keys, mask, random_samples=2)
    with torch.no_grad():
        scores = features.eval()(queries, keys, mask, kernel_diag=False)
        kernel = features.kernel.forward(queries.unsqueeze(1), other.unsqueeze(1))
    singular_values = scores.singular_values.numpy()
    for b in range(2):
        columns = np.ones(other.shape[1], dtype=bool) if mask is None else mask[b].numpy()
        rows = columns if keys is None else np.ones(8, dtype=bool)
        for h in range(2):
            matrix = kernel[b, h].numpy()[rows][:, columns]
            left = scores.left_scores[b, h].numpy()[rows]
            right = scores.right_scores[b, h].numpy()[columns]
            values = singular_values[h]
            exact_left, sigma, exact_right_h = np.linalg.svd(matrix)
            approximation = left / values @ right.T
            left_angles = subspace_angles(left, exact_left[:, :3])
            right_angles = subspace_angles(right, exact_right_h[:3].T)
            shares = sigma**2 / (sigma**2).sum()
            terms = 0.5 * ((left**2 / values).sum() + (right**2 / values).sum())
            expected = {
                "kernel_error": np.linalg.norm(matrix - approximation) / np.linalg.norm(matrix),
                "kernel_scale": np.linalg.norm(approximation) / np.linalg.norm(matrix),
                "optimal_error": np.sqrt((sigma[3:] ** 2).sum()) / np.linalg.norm(matrix),
                "energy": (sigma[:3] ** 2).sum() / (sigma**2).sum(),
                "effective_rank": np.exp(-(shares * np.log(shares)).sum()),
                "left_cosine": np.cos(left_angles).mean(),
                "right_cosine": np.cos(right_angles).mean(),
                "max_angle": np.degrees(max(left_angles.max(), right_angles.max())),
                "singular_value_error": np.linalg.norm(np.sort(values)[::-1] - sigma[:3]) / np.linalg.norm(sigma[:3]),
                "relative_objective": abs(float(scores.objective[b, h])) / terms,
                "random_kernel_error": np.sqrt(1.0 - 9.0 / (rows.sum() * columns.sum())),
            }
            for name, value in expected.items():
                got = float(getattr(fidelity, name)[b, h])
                assert got == pytest.approx(value, rel=1e-9, abs=1e-10), (name, b, h)


# -- the KSVD penalty of a call --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("mode", "options"), [("amortized", {}), ("primal_tokens", {"max_len": 8})])
def test_the_penalty_of_a_training_call_is_eta_times_the_mean_over_sequences_of_the_sum_over_heads(mode, options):
    """A training call leaves eta mean_b sum_h J_bh^2 (sum form) as ``"ksvd_loss"``; an eval-mode call clears it."""
    features = _features(mode, ksvd_weight=0.7, **options).train()
    tokens = torch.randn(3, 8, 16, generator=_generator(20), dtype=DTYPE)
    mask = torch.ones(3, 8, dtype=torch.bool)
    mask[2, 6:] = False
    scores = features(tokens, key_mask=mask)
    penalty = features._added_loss_terms["ksvd_loss"].loss()
    torch.testing.assert_close(penalty, 0.7 * scores.objective.square().sum(-1).mean(), atol=1e-14, rtol=1e-12)
    features.eval()(tokens, key_mask=mask)
    assert features._added_loss_terms["ksvd_loss"] is None


# -- the official KSVD objective of scores per output ------------------------------------------------------------------
@pytest.mark.parametrize("padding", ["excluded", "included"])
@pytest.mark.parametrize("batch", [2, 3], ids=["batch-equals-heads", "batch-differs"])
def test_the_official_objective_of_general_path_scores_per_output_is_the_same_number(padding: str, batch: int):
    """``official_objective`` documents its scores as "the features of one call (or their for_outputs)": on the
    general path (kernel diagonals asked for, no token sums) with a padding mask the number must not change when the
    scores gain an output dimension, as it does not on the paired path."""
    features = _features("primal_tokens", max_len=5, ksvd_form="official", padding=padding)
    tokens = torch.randn(batch, 5, 16, generator=_generator(21), dtype=DTYPE)
    mask = torch.ones(batch, 5, dtype=torch.bool)
    mask[1, 2:] = False
    scores = features(tokens, key_mask=mask, kernel_diag=True)
    assert scores.token_sums is None  # the general path
    expected = features.official_objective(scores, mask)
    torch.testing.assert_close(features.official_objective(scores.for_outputs(1), mask), expected)
