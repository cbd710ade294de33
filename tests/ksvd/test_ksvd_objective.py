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


def test_shapes_that_would_broadcast_into_a_wrong_objective_are_refused():
    """Mismatched shapes used to broadcast silently: a rank-1 weight against rank-s ones (a wrong trace), a (1,)
    Lambda for every direction, 2-D official weights whose N' rows the trace averaged as heads, weights without the
    position dimension under weights_per_position; others failed in torch's words (a mask of another length)."""
    e, r = _randn(B, H, N, S, seed=30), _randn(B, H, N, S, seed=31)
    we, wr = _randn(B, H, P, S, seed=32), _randn(B, H, P, S, seed=33)
    lam = _randn(H, S, seed=34).exp()
    refused = [
        (dict(right_weights=wr[..., :1]), "right_weights of shape"),
        (dict(right_weights=_randn(B, H, P + 1, S, seed=35)), "right_weights of shape"),
        (dict(singular_values=lam[:, :1]), "singular_values of shape"),
        (dict(right_scores=r[..., :2]), "right_scores of shape"),
        (dict(left_scores=e[0, 0, 0]), "left_scores of shape"),
        (dict(right_scores=r[:2]), "batch dimensions .* do not broadcast"),
        (dict(weights_per_position=True), r"left_weights of shape \(\.\.\., 5, p, 3\)"),
        (dict(left_scores=e.numpy()), "left_scores to be a torch.Tensor"),
    ]
    arguments = dict(left_scores=e, right_scores=r, left_weights=we, right_weights=wr, singular_values=lam)
    for change, message in refused:
        with pytest.raises(ValueError, match=f"ksvd_objective: .*{message}"):
            ksvd_objective(**{**arguments, **change})
    e, r, raw_e, raw_r, lam, mask = _official_inputs(seed=36, padded=None)
    official = dict(left_scores=e, right_scores=r, left_weights=raw_e, right_weights=raw_r, singular_values=lam)
    refused = [
        (dict(left_weights=raw_e[0], right_weights=raw_r[0]), r"left_weights of shape \(H, N', 3\)"),
        (dict(right_weights=raw_r[:1]), "right_weights of shape"),
        (dict(left_scores=e[0], right_scores=r[0]), r"expects left_scores of shape \(B, H, N, s\)"),
        (dict(mask=mask[:, :-1]), r"mask of shape \(3, 5\)"),
        (dict(mask=mask, right_scores=r[:, :, :-1]), "a mask needs left_scores and right_scores of the same tokens"),
    ]
    for change, message in refused:
        with pytest.raises(ValueError, match=f"ksvd_objective: .*{message}"):
            ksvd_objective(**{**official, **change}, form="official")
    # one head: the (1, N', s) weights' trace is that head's, against a loop
    got = ksvd_objective(e[:, :1], r[:, :1], raw_e[:1], raw_r[:1], lam[:1], form="official")
    left = torch.stack([(e[b, 0, i] ** 2 / lam[0]).sum() for b in range(B) for i in range(N)]).mean()
    right = torch.stack([(r[b, 0, i] ** 2 / lam[0]).sum() for b in range(B) for i in range(N)]).mean()
    expected = 0.5 * (left + right) - torch.trace(raw_e[0].T @ raw_r[0])
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)
