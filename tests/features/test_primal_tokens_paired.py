"""The paired self-attention path of ``features="primal_tokens"`` (both branches as the halves of one tensor, J from
one reduction) against the general path (float64): scores, both forms of J, the penalty and the gradients of every
parameter, for every padding treatment and both ways of forming X~; its exclusions; bfloat16 autocast. The evenly
spaced positions of padded sequences against ``torch.linspace``."""

from __future__ import annotations

import pytest
import torch

from gpattn.features import PrimalTokensAttentionFeatures
from gpattn.features.primal_tokens_attention_features import evenly_spaced_positions

DTYPE = torch.float64


def _features(padding: str = "excluded", sampled: bool = False, form: str = "official", **kwargs):
    # max_len 5 <= 10 s: one row of W~ per position; max_len 9 > rank_multiple s = 2: N' = 2 evenly spaced tokens
    sizes = {"max_len": 9, "rank_multiple": 1} if sampled else {"max_len": 5}
    features = PrimalTokensAttentionFeatures(12, 3, num_inducing=2, padding=padding, ksvd_form=form, **sizes, **kwargs)
    features = features.to(DTYPE).train()
    with torch.no_grad():  # away from the initial values
        features.kernel.outputscale = 1.7
        features.raw_singular_values.normal_()
    return features


def _run(features, x, mask, kernel_diag: bool):
    """The scores of one call, its penalty and the gradients of a loss that reads every output."""
    features.zero_grad(set_to_none=True)
    scores = features(x, key_mask=mask, kernel_diag=kernel_diag)
    penalty = features._added_loss_terms["ksvd_loss"].loss()
    generator = torch.Generator().manual_seed(1)

    def probe(tensor):
        return (tensor * torch.randn(tensor.shape, generator=generator, dtype=DTYPE)).sum()

    (probe(scores.left_scores) + probe(scores.right_scores) + probe(scores.objective) + penalty).backward()
    grads = {name: value.grad.clone() for name, value in features.named_parameters() if value.grad is not None}
    return scores, penalty.detach(), grads


@pytest.mark.parametrize("form", ["sum", "official"])
@pytest.mark.parametrize("sampled", [False, True], ids=["every-position", "sampled"])
@pytest.mark.parametrize("padding", ["none", "excluded", "included"])
def test_paired_path_equals_the_general_path(padding: str, sampled: bool, form: str):
    torch.manual_seed(0)
    features = _features("excluded" if padding == "none" else padding, sampled, form)
    x = torch.randn(2, 5, 12, dtype=DTYPE)
    mask = None if padding == "none" else torch.tensor([[True] * 5, [True, False, True, True, False]])
    paired, paired_penalty, paired_grads = _run(features, x, mask, kernel_diag=False)
    general, general_penalty, general_grads = _run(features, x, mask, kernel_diag=True)  # the general path
    assert paired.stacked is not None and paired.token_sums is not None
    assert general.stacked is None and general.token_sums is None
    for name in ("left_scores", "right_scores", "objective"):
        torch.testing.assert_close(getattr(paired, name), getattr(general, name), rtol=1e-12, atol=1e-12, msg=name)
    torch.testing.assert_close(paired_penalty, general_penalty, rtol=1e-12, atol=1e-12)
    assert paired_grads.keys() == general_grads.keys()
    assert {"kernel.query_weight", "kernel.key_weight", "left_token_weights", "right_token_weights"} <= set(
        general_grads
    )
    for name, value in general_grads.items():
        torch.testing.assert_close(paired_grads[name], value, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("masked", [False, True], ids=["every-token", "padding"])
def test_token_sums_and_both_objectives_against_the_formulas(masked: bool):
    """S_k, J (sum form) and J_off of the paired path written out from the scores and the raw weights."""
    torch.manual_seed(2)
    features = _features()
    x = torch.randn(2, 5, 12, dtype=DTYPE)
    mask = torch.tensor([[True] * 5, [True, True, True, False, False]]) if masked else torch.ones(2, 5, dtype=bool)
    scores = features(x, key_mask=mask if masked else None, kernel_diag=False)
    m = mask[:, None, :, None].to(DTYPE)  # (B, 1, N, 1)
    e, r, lam = scores.left_scores * m, scores.right_scores * m, features.singular_values
    torch.testing.assert_close(scores.token_sums, (e.square() + r.square()).sum(-2), rtol=1e-12, atol=1e-12)
    weights = features.token_primal_weights(x, mask if masked else None)
    coupling = (weights[0] * weights[1]).sum((-2, -1))
    expected_sum = 0.5 * ((e.square() + r.square()).sum(-2) / lam).sum(-1) - coupling
    torch.testing.assert_close(scores.objective, expected_sum, rtol=1e-12, atol=1e-12)
    count = mask.sum() * features.num_heads  # (sequence, head, real token) positions
    trace = sum(features.left_token_weights[h].T @ features.right_token_weights[h] for h in range(3)).trace() / 3
    expected_official = 0.5 * (((e.square() + r.square()) / lam[:, None]).sum() / count) - trace
    torch.testing.assert_close(features.official_objective(scores, mask if masked else None), expected_official)


def test_paired_scores_are_halves_of_one_stacked_tensor():
    torch.manual_seed(3)
    features = _features()
    scores = features(torch.randn(2, 5, 12, dtype=DTYPE), kernel_diag=False)
    assert scores.stacked.shape == (2, 2, 3, 2, 5) and scores.columns() is scores.stacked
    assert scores.left_scores.data_ptr() == scores.stacked.data_ptr()  # views, no copy
    assert torch.equal(scores.stacked[:, 1].mT, scores.right_scores)
    per_output = scores.for_outputs(1)
    assert per_output.stacked is None and per_output.token_sums.shape == (2, 3, 1, 2)
    torch.testing.assert_close(per_output.token_sums.squeeze(-2), scores.token_sums)


@pytest.mark.parametrize("padding", ["none", "excluded", "included"])
def test_official_objective_of_the_scores_per_output(padding: str):
    """The official J of a paired call's scores is the same number after ``for_outputs`` (whose scores have an extra
    dimension): the count of the means is read from the batch, the heads and the tokens, not the scores' layout."""
    torch.manual_seed(5)
    features = _features("excluded" if padding == "none" else padding, form="official")
    mask = None if padding == "none" else torch.tensor([[True] * 5, [True, True, False, False, False]])
    scores = features(torch.randn(2, 5, 12, dtype=DTYPE), key_mask=mask, kernel_diag=False)
    expected = features.official_objective(scores, mask)
    torch.testing.assert_close(features.official_objective(scores.for_outputs(1), mask), expected)
    torch.testing.assert_close(features.official_objective(scores.for_outputs(2), mask), expected)


@pytest.mark.parametrize("exclusion", ["kernel_diag", "tie_qk"])
def test_each_exclusion_of_the_paired_path(exclusion: str):
    """``takes_paired_path`` is true for plain self-attention and false for each exclusion (causal calls and
    cross-attention are refused by this mode before); an excluded call takes the general path."""
    torch.manual_seed(4)
    features = _features(tie_qk=exclusion == "tie_qk")
    x = torch.randn(2, 5, 12, dtype=DTYPE)
    assert features.takes_paired_path(x, x, causal=False, kernel_diag=False) is (exclusion != "tie_qk")
    assert features.takes_paired_path(x, x, causal=False, kernel_diag=True) is False
    assert features.takes_paired_path(x, x.clone(), causal=False, kernel_diag=False) is False
    assert features.takes_paired_path(x, x, causal=True, kernel_diag=False) is False
    scores = features(x, kernel_diag=exclusion == "kernel_diag")
    assert scores.stacked is None and scores.token_sums is None


@pytest.mark.parametrize("masked", [False, True], ids=["every-token", "padding"])
def test_paired_path_under_bfloat16_autocast(masked: bool):
    """Under CPU autocast (bfloat16) the paired path's products run in bfloat16 (the scores, scaled by the float32
    output scale, differ from float32's by bfloat16 rounding, within 2e-2) and its token sums, J and the official J
    are float32; the gradients are finite and close to float32's."""
    torch.manual_seed(7)
    features = PrimalTokensAttentionFeatures(32, 2, num_inducing=4, max_len=40, ksvd_form="official").train()
    x = torch.randn(3, 40, 32)
    mask = (torch.arange(40) < torch.tensor([40, 31, 17])[:, None]) if masked else None
    results = {}
    for precision in ("float32", "bfloat16"):
        features.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bfloat16"):
            scores = features(x, key_mask=mask, kernel_diag=False)
            penalty = features._added_loss_terms["ksvd_loss"].loss()
        assert scores.stacked.dtype == torch.float32
        assert scores.token_sums.dtype == scores.objective.dtype == penalty.dtype == torch.float32
        (scores.stacked.float().square().mean() + penalty).backward()
        results[precision] = (scores, {k: v.grad.clone() for k, v in features.named_parameters()})
    (reference, reference_grads), (low, low_grads) = results["float32"], results["bfloat16"]
    relative = (low.stacked.float() - reference.stacked).norm() / reference.stacked.norm()
    assert 1e-4 < relative < 2e-2, relative  # rounded as bfloat16 products are, no further
    torch.testing.assert_close(low.token_sums, reference.token_sums, rtol=2e-2, atol=0.0)
    for name, value in reference_grads.items():
        assert torch.isfinite(low_grads[name]).all(), name
        assert (low_grads[name] - value).norm() <= 5e-2 * value.norm() + 1e-6, name


@pytest.mark.parametrize("steps", [1, 2, 3, 7, 15, 20, 64, 101])
def test_evenly_spaced_positions_are_torch_linspace(steps: int):
    """Every row is ``torch.linspace(0, end, steps, dtype=torch.long)``, including the ends where exact rational
    arithmetic would differ (e.g. end 58, 15 steps: position 7 is 28, not 29)."""
    ends = torch.arange(3000)
    expected = torch.stack([torch.linspace(0, int(end), steps, dtype=torch.long) for end in ends])
    assert torch.equal(evenly_spaced_positions(ends, steps), expected)
    if steps == 15:
        assert int(evenly_spaced_positions(torch.tensor([58]), 15)[0, 7]) == 28


def test_padded_sequences_sample_their_real_tokens_under_compile_without_a_break_of_their_own():
    """With sampled tokens and a padding mask, the positions of every sequence are formed at once: the features
    compile to one graph (they broke on the distinct lengths' loop before) and give eager mode's scores."""
    torch.manual_seed(8)
    features = PrimalTokensAttentionFeatures(12, 3, num_inducing=2, max_len=30, rank_multiple=2).train()
    x = torch.randn(4, 30, 12)
    mask = torch.arange(30) < torch.tensor([30, 21, 9, 14])[:, None]
    explained = torch._dynamo.explain(lambda x, mask: features(x, key_mask=mask, kernel_diag=False).stacked)(x, mask)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    compiled = torch.compile(lambda x, mask: features(x, key_mask=mask, kernel_diag=False).stacked, backend="eager")
    torch.testing.assert_close(compiled(x, mask), features(x, key_mask=mask, kernel_diag=False).stacked)
