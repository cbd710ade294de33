"""The magnitude guard shared by the attention layers (gpattn.validation.check_overflow): its rule, its message, and
the layers that raise it where their results would otherwise be NaN (issue 24, item 4)."""

from __future__ import annotations

import math

import pytest
import torch

from gpattn.attention import CGPTAttention, SGPAAttention, SoftmaxAttention, SymmetricSVGPAttention, softmax_attention
from gpattn.validation import (
    check_overflow,
    check_token_magnitude,
    square_limit,
    token_magnitude_limit,
    within_bound,
)

GROWTH = "the scores grow like |x|^2"


@pytest.mark.parametrize(
    ("dtype", "limit"), [(torch.float16, 0.25594), (torch.bfloat16, 1.8411e16), (torch.float32, 1.8447e16)]
)
def test_limit_is_the_square_root_of_the_largest_value_over_a_thousand(dtype, limit):
    assert token_magnitude_limit(dtype) == pytest.approx(limit, rel=1e-4)
    assert token_magnitude_limit(torch.float64) == pytest.approx(math.sqrt(1.7976931348623157e308) / 1e3)


def test_message_names_the_magnitude_the_dtype_and_the_remedy():
    tokens = torch.tensor([[1.0, -2e17]])
    message = (
        r"MyLayer: the input tokens reach \|x\| = 2e\+17, too large for torch.float32: the scores grow like \|x\|\^2, "
        r"which overflows beyond about sqrt\(finfo.max\) = 1.84e\+19; rescale the inputs \(e.g. a LayerNorm before "
        r"the layer\) or use float64$"
    )
    with pytest.raises(ValueError, match=message):
        check_token_magnitude(tokens, GROWTH, where="MyLayer")
    with pytest.raises(ValueError, match=r"too large for torch.float64: .*before the layer\)$"):  # no "use float64"
        check_token_magnitude(torch.tensor([1e152], dtype=torch.float64), GROWTH)
    limit = token_magnitude_limit(torch.float32)
    check_token_magnitude([torch.tensor([limit * 0.99]), torch.tensor([-limit * 0.99])], GROWTH)  # within: nothing


def test_overflow_check_reads_the_tokens_only_once_a_result_is_not_finite():
    huge, small = torch.tensor([1e30]), torch.tensor([1.0])
    assert check_overflow((torch.ones(3), None), huge, GROWTH)  # finite results: the tokens are not looked at
    assert not check_overflow((torch.tensor([1.0, math.nan]),), small, GROWTH)  # NaN from small tokens: the caller's
    with pytest.raises(ValueError, match="reach"):
        check_overflow((torch.ones(2), torch.tensor([math.inf])), [small, huge], GROWTH, where="Layer")
    assert check_overflow((torch.empty(2, device="meta"),), huge, GROWTH)  # no values on meta: skipped


def test_within_bound_against_the_largest_magnitude():
    """within_bound against max |x| <= bound written out: tensors of one dtype and of several (float32 and float64,
    each compared in its own dtype's values), NaN, infinities, None and empty entries, and the bound itself."""
    small, large = torch.tensor([1.0, -3.0]), torch.tensor([2.0, -5.0], dtype=torch.float64)
    assert within_bound([small, None, torch.empty(0)])
    assert within_bound([small, large], bound=5.0)  # |-5| = 5: at the bound
    assert not within_bound([small, large], bound=4.999)
    assert not within_bound([small, torch.tensor([math.nan], dtype=torch.float64)])
    assert not within_bound([torch.tensor([-math.inf]), large])
    assert within_bound([torch.tensor([3e38]), torch.tensor([1e300], dtype=torch.float64)])  # finite, no bound
    assert not within_bound([torch.tensor([3e38])], bound=1e38)


def test_within_bound_reads_one_number_with_two_operators():
    """One tensor group: the fused max-norm pass and its read, compared on the host (the comparison on the device was
    three more operators)."""
    from torch.profiler import ProfilerActivity, profile

    value = torch.randn(10)
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        assert within_bound([value], bound=100.0)
    top_level = [
        event.name for event in profiler.events() if event.name.startswith("aten::") and event.cpu_parent is None
    ]
    assert top_level == ["aten::_foreach_norm", "aten::item"], top_level


LAYERS = {
    "softmax": lambda: SoftmaxAttention(16, 2),
    "sgpa": lambda: SGPAAttention(16, 2, num_inducing=3),
    "cgpt": lambda: CGPTAttention(16, 2),
}


@pytest.mark.parametrize(("dtype", "magnitude"), [(torch.float32, 1e20), (torch.float64, 1e160)])
@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("name", list(LAYERS))
def test_layers_refuse_tokens_beyond_the_range_of_their_dtype(name, training, dtype, magnitude):
    """Tokens spread over 1e20 (float32) or 1e160 (float64): before, NaN outputs (softmax, SGPA) or a NotPSDError
    blaming the jitter (CGPT); now the guard's message, in eval and in training mode."""
    torch.manual_seed(0)
    layer = LAYERS[name]().to(dtype).train(training)
    tokens = magnitude * torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1), dtype=dtype)
    layer_name = type(layer).__name__
    with pytest.raises(ValueError, match=rf"{layer_name}.*: the input tokens reach .*too large for {dtype}.*rescale"):
        layer(tokens)


@pytest.mark.parametrize("training", [False, True])
def test_softmax_refuses_overflowing_scores_whatever_its_kernel_returns(monkeypatch, training):
    """The fused CPU kernel of torch 2.13 returned zeros instead of NaN for overflowing scores on an AMD EPYC
    processor, so the guard checks the scores, not only the output: with a kernel that always returns zeros the
    tokens of 1e20 are still refused (the check of the output alone let them through)."""
    monkeypatch.setattr(softmax_attention.F, "scaled_dot_product_attention", lambda q, k, v, **_: torch.zeros_like(q))
    layer = SoftmaxAttention(16, 2).train(training)
    tokens = 1e20 * torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match=r"SoftmaxAttention: the input tokens reach .*too large for torch.float32"):
        layer(tokens)


def _softmax_reference(layer: SoftmaxAttention, tokens: torch.Tensor) -> torch.Tensor:
    # the layer written out: explicit scores and softmax
    queries, keys, values = (
        layer.split_heads(projection(tokens)) for projection in (layer.q_proj, layer.k_proj, layer.v_proj)
    )
    output = (queries @ keys.mT / math.sqrt(layer.head_dim)).softmax(-1) @ values
    return layer.out_proj(output.transpose(1, 2).flatten(2))


def _diagonal_layer(queries: list[float], keys: list[float]) -> SoftmaxAttention:
    # one head of width 4: q = diag(queries) x, k = diag(keys) x, v = x, no biases, out_proj the identity
    layer = SoftmaxAttention(4, 1).double()
    with torch.no_grad():
        for projection, diagonal in ((layer.q_proj, queries), (layer.k_proj, keys), (layer.v_proj, [1.0] * 4)):
            projection.bias.zero_()
            projection.weight.copy_(torch.diag(torch.tensor(diagonal, dtype=torch.float64)))
        layer.out_proj.bias.zero_()
        layer.out_proj.weight.copy_(torch.eye(4, dtype=torch.float64))
    return layer


def test_softmax_past_the_bound_checks_the_products_themselves(monkeypatch):
    """Queries and keys of 1e19 pass the bound p max|q| max|k| (3.4e38 in float32) without a single product
    <q, k> overflowing (queries and keys orthogonal): no error although the tokens are beyond float32's token limit
    (1.8e16), the output is the float64 reference's, and the products were formed in blocks (one query each)."""
    monkeypatch.setattr(softmax_attention, "SCORE_BLOCK", 3)  # one head, 3 keys: a block of one query
    blocks = []
    matmul = torch.Tensor.__matmul__
    monkeypatch.setattr(torch.Tensor, "__matmul__", lambda a, b: blocks.append(a.shape) or matmul(a, b))
    layer = _diagonal_layer([1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 0.0]).float()
    tokens = torch.tensor([[[1e19, 0.0, 0.0, 1.0], [0.0, 1e19, 0.0, 2.0], [0.0, 0.0, 1e19, 3.0]]])
    output = layer(tokens)
    assert [tuple(shape) for shape in blocks] == [(1, 1, 4)] * 3  # the three blocks of the check
    expected = _softmax_reference(layer.double(), tokens.double())
    torch.testing.assert_close(output.double(), expected, rtol=1e-6, atol=1e-6 * expected.abs().max().item())


def test_softmax_refuses_products_that_overflow_before_their_scaling():
    """p max|q| max|k| is the bound, not sqrt(p) max|q| max|k|: the fused CPU kernel forms <q, k> before its scaling
    by 1/sqrt(p), and with k = -q of 9e18 in 16 dimensions the products (-1.3e39) overflow float32 while the scaled
    scores would not; the kernel returned zeros here (the float64 reference: -1.24). Refused."""
    layer = SoftmaxAttention(16, 1)
    with torch.no_grad():
        for projection in (layer.q_proj, layer.k_proj, layer.v_proj):
            projection.bias.zero_()
        layer.q_proj.weight.copy_(torch.eye(16))
        layer.k_proj.weight.copy_(-torch.eye(16))
    tokens = torch.full((1, 3, 16), 9e18)
    with pytest.raises(ValueError, match=r"the input tokens reach \|x\| = 9e\+18, too large for torch.float32"):
        layer(tokens)


def test_softmax_in_float16_bounds_its_products_in_float32():
    """float16 queries and keys of 300 give products of 3.6e5, beyond float16's largest value but within float32's,
    in which the kernels accumulate: the output is the float64 reference's and nothing is refused (ordinary tokens,
    |x| = 1, are beyond float16's token limit of 0.26, which the guard reads only once a product overflows)."""
    torch.manual_seed(0)
    layer = _diagonal_layer([300.0] * 4, [300.0] * 4)
    tokens = torch.tensor([[[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, -1.0]]], dtype=torch.float64)
    output = layer.half()(tokens.half())
    expected = _softmax_reference(layer.double(), tokens)
    torch.testing.assert_close(output.double(), expected, rtol=0, atol=2e-3)


@pytest.mark.parametrize("block", [1, 2**22], ids=["one-query-blocks", "one-block"])
def test_softmax_score_check_skips_the_scores_no_query_attends_with(monkeypatch, block):
    """Past the bound the scores are formed and checked where a query attends: a key whose scores overflow is
    refused unless it is masked (padding) or later than every query that would meet it (causal)."""
    monkeypatch.setattr(softmax_attention, "SCORE_BLOCK", block * 2 * 4)  # 2 heads, 4 keys
    queries = torch.full((1, 2, 4, 8), 10.0)
    keys = torch.ones(1, 2, 4, 8)
    keys[..., -1, :] = 1e38  # its scores with every query (8 * 10 * 1e38 / sqrt(8)) overflow float32
    heads = torch.zeros(1, 2, 4, 8)  # what a kernel that hides the overflow returns
    check = softmax_attention._scores_within_range
    assert not check(queries, keys, heads, None, False)
    padding = torch.tensor([[True, True, True, False]])
    assert check(queries, keys, heads, padding[:, None, None, :], False)  # masked: never attended
    assert not check(queries, keys, heads, None, True)  # causal: the last query meets the last key
    queries[..., -1, :] = 0.0  # ... with a score of 0: no query attends with an overflowing score
    assert check(queries, keys, heads, None, True)
    assert not check(queries, keys, heads, None, False)  # without the causal mask the others do
    queries[..., -1, :] = 10.0
    keys[..., -1, :] = 1.0
    keys[..., 1, :] = 1e38  # a key the later queries attend to
    assert not check(queries, keys, heads, None, True)
    assert check(queries, keys, heads.fill_(1.0), None, False) is False  # a finite output does not settle it
    assert not check(torch.ones(1, 2, 4, 8), torch.ones(1, 2, 4, 8), heads.fill_(math.nan), None, False)
    assert check(torch.ones(1, 2, 4, 8), torch.ones(1, 2, 4, 8), heads.fill_(1.0), None, False)


@pytest.mark.parametrize(("dtype", "magnitude"), [(torch.float32, 1e6), (torch.float32, 1e20), (torch.float64, 1e160)])
def test_the_symmetric_svgp_far_from_its_inducing_points_gives_the_prior(dtype, magnitude):
    """The symmetric SVGP's stationary RBF kernel (GPyTorch's, centred distances) vanishes far from every inducing
    point: the eval mean is the prior's (zero GP output, so the output is out_proj's bias) and training draws stay
    finite: the exact limit, no guard needed."""
    torch.manual_seed(0)
    layer = SymmetricSVGPAttention(16, 2, num_inducing=3).to(dtype).eval()
    tokens = magnitude * torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1), dtype=dtype)
    output = layer(tokens)
    torch.testing.assert_close(output, layer.out_proj.bias.detach().expand_as(output), rtol=0, atol=0)
    assert torch.isfinite(layer.train()(tokens)).all()


# -- the KEP and Primal layers: the penalty, its gradients and the draws (issue 24, item 5) ---------------------------
KSVD_ROWS = ("kep_svgp", "kep_svgp_sym", "kep_svgp_paper", "primal", "primal_paper")


def _ksvd_layer(name: str, dtype: torch.dtype = torch.float32):
    from gpattn.attention import build_attention

    torch.manual_seed(0)
    extra = {"max_len": 5} if name.endswith("_paper") else {}
    return build_attention(name, 16, 2, num_inducing=3, **extra).to(dtype)


def _training_step(layer, tokens):
    """Output, loss (output, KSVD penalty and KL) and the gradients of one training step."""
    layer.train()
    output = layer(tokens)
    loss = output.square().mean() + sum(term.loss() for term in layer.features.added_loss_terms())
    loss = loss + layer.kl_divergence()
    loss.backward()
    return output, loss, [parameter.grad for parameter in layer.parameters() if parameter.grad is not None]


def test_limits_of_the_penalty_and_its_gradients():
    assert token_magnitude_limit(torch.float32, power=4) == pytest.approx((3.4028234663852886e38 / 1e6) ** 0.25)
    assert token_magnitude_limit(torch.float32, power=5) == pytest.approx(3.21e6, rel=0.01)
    assert token_magnitude_limit(torch.float64, power=5) == pytest.approx(2.82e60, rel=0.01)
    assert square_limit(torch.float32) == pytest.approx(5.83e17, rel=0.01) and square_limit(torch.float16) > 8


@pytest.mark.parametrize("name", KSVD_ROWS)
def test_a_penalty_that_overflows_is_refused_in_the_forward_pass(name):
    """x * 1e10 in float32: before, a finite output with an infinite KSVD penalty (the loop called it divergence)."""
    tokens = 1e10 * torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match=r"reach \|x\| = .*float32: the KSVD penalty eta J\^2 grows like \|x\|\^4"):
        _training_step(_ksvd_layer(name), tokens)


@pytest.mark.parametrize("masked", [False, True], ids=["every-token", "padding"])
def test_a_penalty_that_overflows_is_refused_on_the_fused_path_with_a_padding_mask(masked):
    """The fused amortised path (kep_svgp) with and without a padding mask: the same message as the other paths."""
    tokens = 1e10 * torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[True] * 5, [True, True, True, False, False]]) if masked else None
    layer = _ksvd_layer("kep_svgp").train()
    with pytest.raises(ValueError, match=r"reach \|x\| = .*float32: the KSVD penalty eta J\^2 grows like \|x\|\^4"):
        layer(tokens, mask)


@pytest.mark.parametrize("tokens_need_gradients", [False, True], ids=["parameters", "tokens"])
@pytest.mark.parametrize("name", ("kep_svgp", "primal"))
def test_gradients_that_overflow_are_refused_by_the_backward_pass(name, tokens_need_gradients):
    """x * 1e8 in float32: the output and the penalty are finite, their gradients are not (before: NaN and Inf in
    the projections' gradients, which the loop called divergence); whether the tokens need a gradient or not (the
    fused amortised path of kep_svgp then checks the projections' gradients)."""
    tokens = 1e8 * torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    tokens.requires_grad_(tokens_need_gradients)
    layer = _ksvd_layer(name).train()
    output = layer(tokens)
    loss = output.square().mean() + sum(term.loss() for term in layer.features.added_loss_terms())
    assert torch.isfinite(output).all() and torch.isfinite(loss)
    with pytest.raises(ValueError, match=r"gradients of the KSVD penalty grow like \|x\|\^5"):
        loss.backward()


def test_paper_draws_beyond_the_range_are_refused():
    """kep_svgp_paper at x * 1e19 in float32: before, a finite mean and NaN draws."""
    from gpattn.attention import sample_attention

    layer = _ksvd_layer("kep_svgp_paper").eval()
    tokens = 1e19 * torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match=r"PrimalTokensAttentionFeatures.*reach .*the variances of the draws"):
        with sample_attention(layer):
            layer(tokens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("name", KSVD_ROWS)
def test_every_magnitude_gives_finite_numbers_or_the_guard(name, dtype):
    """From 1 to far beyond the range, in training (output, loss, gradients) and in sampling: finite, or the guard's
    ValueError; the eval mean, where finite, is float64's to the dtype's rounding."""
    from gpattn.attention import sample_attention

    largest = torch.finfo(dtype).max
    scales = [10.0**k for k in range(0, int(math.log10(largest)) + 2, 3 if dtype != torch.float64 else 15)]
    base = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    reference = _ksvd_layer(name, torch.float64).eval()
    tolerance = {torch.float32: 1e-4, torch.float64: 1e-10, torch.float16: 2e-2}[dtype]
    for scale in scales:
        tokens = (base * scale).to(dtype)
        if not torch.isfinite(tokens).all():
            continue
        try:
            output, loss, gradients = _training_step(_ksvd_layer(name, dtype), tokens)
            assert torch.isfinite(output).all() and torch.isfinite(loss), (scale, "training")
            assert all(torch.isfinite(gradient).all() for gradient in gradients), (scale, "gradients")
        except ValueError as error:
            assert "too large for" in str(error), error
        layer = _ksvd_layer(name, dtype).eval()
        try:
            with torch.no_grad():
                mean = layer(tokens)
                with sample_attention(layer):
                    draw = layer(tokens)
        except ValueError as error:
            assert "too large for" in str(error), error
            continue
        assert torch.isfinite(mean).all() and torch.isfinite(draw).all(), (scale, "eval")
        with torch.no_grad():
            expected = reference(tokens.double())
        assert (mean.double() - expected).abs().max() <= tolerance * expected.abs().max() + tolerance, scale
