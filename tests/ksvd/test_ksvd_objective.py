"""The KSVD objective's two forms and its per-position weights against loops written here (float64)."""

from __future__ import annotations

import pytest
import torch

from gpattn.ksvd import ksvd_objective
from gpattn.ksvd.ksvd_objective import ksvd_objective_from_sums, official_objective_from_sums

DTYPE = torch.float64
B, H, N, P, S, POSITIONS = 3, 2, 5, 4, 3, 6


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DTYPE)


def test_sum_form_is_the_token_sum_per_sequence_and_head():
    e, r = _randn(B, H, N, S, seed=0), _randn(B, H, N, S, seed=1)
    we, wr = _randn(B, H, P, S, seed=2), _randn(B, H, P, S, seed=3)
    lam = _randn(H, S, seed=4).exp()
    got = ksvd_objective(e, r, we, wr, lam)
    for b in range(B):
        for h in range(H):
            inverse = torch.diag(1 / lam[h])
            expected = 0.5 * sum(e[b, h, i] @ inverse @ e[b, h, i] for i in range(N))
            expected = expected + 0.5 * sum(r[b, h, j] @ inverse @ r[b, h, j] for j in range(N))
            expected = expected - torch.trace(we[b, h].T @ wr[b, h])
            torch.testing.assert_close(got[b, h], expected, atol=1e-12, rtol=0)


def test_weights_per_position_average_the_trace():
    e, r = _randn(B, H, N, S, seed=5), _randn(B, H, N, S, seed=6)
    we, wr = _randn(B, H, N, P, S, seed=7), _randn(B, H, N, P, S, seed=8)
    lam = _randn(H, S, seed=9).exp()
    got = ksvd_objective(e, r, we, wr, lam, weights_per_position=True)
    traces = torch.stack([torch.einsum("bhps,bhps->bh", we[:, :, i], wr[:, :, i]) for i in range(N)]).mean(0)
    expected = ksvd_objective(e, r, torch.zeros(B, H, P, S, dtype=DTYPE), torch.zeros(B, H, P, S, dtype=DTYPE), lam)
    torch.testing.assert_close(got, expected - traces, atol=1e-12, rtol=0)


def _official_inputs(seed: int, padded: tuple[int, int] | None) -> tuple[torch.Tensor, ...]:
    """Scores e, r (B, H, N, S), raw weights (H, POSITIONS, S), singular values (H, S) and a (B, N) mask whose
    sequence ``padded[0]`` is padded from token ``padded[1]`` on (all real with ``None``)."""
    e, r = _randn(B, H, N, S, seed=seed), _randn(B, H, N, S, seed=seed + 1)
    raw_e, raw_r = _randn(H, POSITIONS, S, seed=seed + 2), _randn(H, POSITIONS, S, seed=seed + 3)
    lam = _randn(H, S, seed=seed + 4).exp()
    mask = torch.ones(B, N, dtype=torch.bool)
    if padded is not None:
        mask[padded[0], padded[1] :] = False
    return e, r, raw_e, raw_r, lam, mask


@pytest.mark.parametrize("masked", [False, True])
def test_official_form_means_over_real_tokens_and_the_trace_of_the_raw_weights(masked: bool):
    e, r, raw_e, raw_r, lam, mask = _official_inputs(seed=10, padded=(0, 3) if masked else None)
    got = ksvd_objective(e, r, raw_e, raw_r, lam, form="official", mask=mask if masked else None)
    left, right = [], []
    for b in range(B):
        for h in range(H):
            for i in range(N):
                if mask[b, i]:
                    left.append((e[b, h, i] ** 2 / lam[h]).sum())
                    right.append((r[b, h, i] ** 2 / lam[h]).sum())
    trace = torch.trace(sum(raw_e[h].T @ raw_r[h] for h in range(H)) / H)
    expected = 0.5 * torch.stack(left).mean() + 0.5 * torch.stack(right).mean() - trace
    assert got.shape == ()
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)


def test_unknown_form():
    x = torch.ones(1, 2, 1, dtype=DTYPE)
    with pytest.raises(ValueError, match="form"):
        ksvd_objective(x, x, x, x, torch.ones(1, 1, dtype=DTYPE), form="mean")


def test_objective_from_sums_equals_the_sum_form():
    """J from the token sums of the squared scores and the trace equals the sum form on the scores themselves."""
    e, r = _randn(B, H, N, S, seed=20), _randn(B, H, N, S, seed=21)
    we, wr = _randn(B, H, P, S, seed=22), _randn(B, H, P, S, seed=23)
    lam = _randn(H, S, seed=24).exp()
    sums = e.pow(2).sum(-2) + r.pow(2).sum(-2)  # (B, H, S)
    coupling = torch.einsum("bhps,bhps->bh", we, wr)
    torch.testing.assert_close(
        ksvd_objective_from_sums(sums, coupling, lam), ksvd_objective(e, r, we, wr, lam), atol=1e-12, rtol=0
    )


@pytest.mark.parametrize("masked", [False, True])
def test_official_objective_from_sums_equals_the_official_form(masked: bool):
    """J_off from the token sums of the squared scores over the real tokens and their count equals the official form
    on the scores themselves."""
    e, r, raw_e, raw_r, lam, mask = _official_inputs(seed=30, padded=(1, 2) if masked else None)
    m = mask[:, None, :, None].to(DTYPE)
    sums = ((e * m).square() + (r * m).square()).sum(-2)  # (B, H, S)
    expected = ksvd_objective(e, r, raw_e, raw_r, lam, form="official", mask=mask if masked else None)
    got = official_objective_from_sums(sums, lam, mask.sum() * H, raw_e, raw_r)
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)


def test_options_a_form_does_not_read_are_refused():
    """The sum form ignored a mask of any shape (J over the padded tokens, no error); the official form ignored
    weights_per_position."""
    scores, weights, values = torch.ones(2, 3, 4), torch.ones(2, 5, 4), torch.ones(2, 4)
    with pytest.raises(ValueError, match=r"mask= is read by form='official' only"):
        ksvd_objective(scores, scores, weights, weights, values, mask=torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"weights_per_position is read by form='sum' only"):
        ksvd_objective(scores, scores, weights, weights, values, form="official", weights_per_position=True)
