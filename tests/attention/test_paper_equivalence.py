"""gpattn's paper configurations against dense transcriptions of the papers' official code, float64.

The references below are written here from the formulas of the official KEP-SVGP code (``KEP_SVGPAttention``:
``gen_weights``, ``forward``, the KL; ``compute_loss``: the KSVD loss) and of the official Primal-Attention code
(``PrimalAttention.forward``, the KSVD loss of ``train_one_epoch``), with the same weights loaded into gpattn's layers:

* scores: :math:`\\tilde X_h` = the head's channel block of the layer input at ``linspace(0, N - 1, N')`` (all tokens
  when ``N' = N``), :math:`W_e = \\tilde X_h^\\top \\tilde W_e`, :math:`e = \\mathrm{normalize}(x W_{q,h}^\\top) W_e`,
  :math:`r = \\mathrm{normalize}(x W_{k,h}^\\top) W_r`;
* KEP-SVGP mean: ``(e + r) Lambda^{-1} m_u`` (``concate``: ``[e; r]`` on the token axis, then ``final_weight`` and
  ``embed_len_weight``), ``final_weight`` shared by the heads, no output projection;
* Primal-Attention: ``concate_weight([e, r])`` per head, heads concatenated, ``proj``;
* KSVD: official ``(mean ||e Lambda^{-1/2}||^2 / 2 + mean ||r Lambda^{-1/2}||^2 / 2 - Tr(mean_h We~^T Wr~))^2``,
  sum form ``mean_b sum_h J_bh^2``;
* the official KL (a transcription of its five terms) and the distributions its sampling draws from.

Every quantity is compared at 1e-10 (absolute, or relative where stated).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from gpattn.attention import KEPSVGPAttention, PrimalAttention
from gpattn.features import PrimalTokensAttentionFeatures

DTYPE = torch.float64
TOL = 1e-10
B, N, C, H = 2, 6, 12, 2  # head width 6
HD = C // H


@pytest.fixture(autouse=True, params=["paired", "general"])
def primal_tokens_path(request, monkeypatch) -> str:
    """Every test runs on both paths of the primal-token features: the paired self-attention path (the layers'
    default) and the general one (the path of calls with the kernel diagonals or tied weights), each against the
    official code."""
    if request.param == "general":
        monkeypatch.setattr(PrimalTokensAttentionFeatures, "takes_paired_path", lambda self, *arguments: False)
    return request.param


def _randn(*shape: int, seed: int) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DTYPE)


def _rand(*shape: int, seed: int) -> Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed), dtype=DTYPE)


# -- the official parameters and their dense transcription -------------------------------------------------------
def official_parameters(rank: int, length: int, seed: int = 0, positions: int | None = None) -> dict[str, Tensor]:
    """Random weights with the official shapes: ``qk`` (2C, C), ``we``/``wr`` (H, N', s), ``log_lambda_sqrt_inv``
    (H, s), ``m_u`` (H, s, s), ``s_sqrt_low_triangle`` (H, s, s, s), ``log_ssqrt`` (H, s, s), ``final_weight``
    (hd, s) + bias, ``embed_len_weight`` (N, 2N), and Primal-Attention's ``Lambda`` (H, s), ``concate_weight``
    (hd, 2s) + bias, ``proj`` (C, C) + bias."""
    positions = min(length, 10 * rank) if positions is None else positions
    return {
        "qk": _randn(2 * C, C, seed=seed) * C**-0.5,
        "we": _randn(H, positions, rank, seed=seed + 1) * positions**-0.5,
        "wr": _randn(H, positions, rank, seed=seed + 2) * positions**-0.5,
        "log_lambda_sqrt_inv": _rand(H, rank, seed=seed + 3) - 0.5,
        "m_u": _randn(H, rank, rank, seed=seed + 4),
        "s_sqrt_low_triangle": _randn(H, rank, rank, rank, seed=seed + 5),
        "log_ssqrt": _randn(H, rank, rank, seed=seed + 6),
        "final_weight": _randn(HD, rank, seed=seed + 7) * rank**-0.5,
        "final_bias": _randn(HD, seed=seed + 8),
        "embed_len_weight": _randn(length, 2 * length, seed=seed + 9) * (2 * length) ** -0.5,
        "primal_lambda": _rand(H, rank, seed=seed + 10) + 0.5,
        "concate_weight": _randn(HD, 2 * rank, seed=seed + 11) * (2 * rank) ** -0.5,
        "concate_bias": _randn(HD, seed=seed + 12),
        "proj": _randn(C, C, seed=seed + 13) * C**-0.5,
        "proj_bias": _randn(C, seed=seed + 14),
    }


def official_scores(params: dict[str, Tensor], x: Tensor) -> dict[str, Tensor]:
    """e, r (B, H, N, s) and the data weights We, Wr (B, H, hd, s) as the official code forms them."""
    batch, length, _ = x.shape
    positions = params["we"].shape[1]
    index = torch.arange(length) if positions == length else torch.linspace(0, length - 1, positions).long()
    heads_x = x.reshape(batch, length, H, HD).permute(0, 2, 1, 3)  # (B, H, N, hd): the input's channel blocks
    sampled = heads_x[:, :, index]  # X~_h: (B, H, N', hd)
    we = sampled.mT @ params["we"]  # X~_h^T We~: (B, H, hd, s)
    wr = sampled.mT @ params["wr"]
    q = (x @ params["qk"][:C].T).reshape(batch, length, H, HD).permute(0, 2, 1, 3)
    k = (x @ params["qk"][C:].T).reshape(batch, length, H, HD).permute(0, 2, 1, 3)
    phi_q, phi_k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    return {"e": phi_q @ we, "r": phi_k @ wr, "we": we, "wr": wr}


def official_lambda_inverse(params: dict[str, Tensor]) -> Tensor:
    """KEP-SVGP: Lambda^{-1} = exp(log_lambda_sqrt_inv)^2, shape (H, s)."""
    return params["log_lambda_sqrt_inv"].exp().pow(2)


def official_kep_mean(params: dict[str, Tensor], x: Tensor, concate: bool) -> Tensor:
    """The official KEP-SVGP output with the noise left out (its mean), (B, N, C)."""
    scores = official_scores(params, x)
    lam_inv = official_lambda_inverse(params)[None, :, None, :]
    score = torch.cat([scores["e"], scores["r"]], dim=2) if concate else scores["e"] + scores["r"]
    mean = (score * lam_inv) @ params["m_u"]  # (B, H, N or 2N, d = s)
    out = mean @ params["final_weight"].T + params["final_bias"]  # final_weight shared by the heads
    if concate:  # embed_len_weight on the token axis (2N -> N), its bias zero in these tests
        out = params["embed_len_weight"] @ out
    return out.permute(0, 2, 1, 3).reshape(x.shape[0], x.shape[1], C)


def official_ksvd_loss(e: Tensor, r: Tensor, lam_inv: Tensor, we: Tensor, wr: Tensor) -> Tensor:
    """(mean ||e Lambda^{-1/2}||^2 / 2 + mean ||r Lambda^{-1/2}||^2 / 2 - Tr(mean_h We~^T Wr~))^2."""
    root = lam_inv.sqrt()[None, :, None, :]
    escore = ((e * root).norm(dim=-1) ** 2).mean() / 2
    rscore = ((r * root).norm(dim=-1) ** 2).mean() / 2
    trace = torch.einsum("hps,hpd->hsd", we, wr).mean(0).trace()
    return (escore + rscore - trace) ** 2


def sum_form_ksvd_loss(e: Tensor, r: Tensor, lam_inv: Tensor, we: Tensor, wr: Tensor) -> Tensor:
    """mean_b sum_h J_bh^2, J = 1/2 sum_i e_i^T Lambda^{-1} e_i + 1/2 sum_j r_j^T Lambda^{-1} r_j - Tr(We^T Wr)."""
    lam = lam_inv[None, :, None, :]
    objective = 0.5 * (e.pow(2) * lam).sum((-2, -1)) + 0.5 * (r.pow(2) * lam).sum((-2, -1))
    objective = objective - torch.einsum("bhps,bhps->bh", we, wr)
    return objective.pow(2).sum(-1).mean()


def official_primal_output(params: dict[str, Tensor], x: Tensor) -> Tensor:
    """The official Primal-Attention output (B, N, C): concate_weight([e, r]) per head, heads concatenated, proj."""
    scores = official_scores(params, x)
    out = torch.cat([scores["e"], scores["r"]], dim=-1) @ params["concate_weight"].T + params["concate_bias"]
    out = out.permute(0, 2, 1, 3).reshape(x.shape[0], x.shape[1], C)
    return out @ params["proj"].T + params["proj_bias"]


# -- loading the official weights into gpattn --------------------------------------------------------------------
def _load_features(layer: KEPSVGPAttention | PrimalAttention, params: dict[str, Tensor], lam: Tensor) -> None:
    features = layer.features
    with torch.no_grad():
        features.kernel.query_weight.copy_(params["qk"][:C].reshape(H, HD, C))
        features.kernel.key_weight.copy_(params["qk"][C:].reshape(H, HD, C))
        features.kernel.initialize(outputscale=torch.ones(H, dtype=DTYPE))
        features.left_token_weights.copy_(params["we"])
        features.right_token_weights.copy_(params["wr"])
        constraint = features.raw_singular_values_constraint
        features.raw_singular_values.copy_(constraint.inverse_transform(lam))


def gpattn_kep(
    params: dict[str, Tensor],
    merge: str,
    shared: bool,
    ksvd_form: str = "official",
    max_len: int | None = None,
    **options,
) -> KEPSVGPAttention:
    """A gpattn KEP-SVGP layer holding the official weights: the paper's configuration (primal_tokens, d_out = s;
    ``max_len`` default the reference's length; ``options``: the features' options, e.g. the CoLA layer's)."""
    rank, length = params["we"].shape[-1], params["embed_len_weight"].shape[0]
    layer = KEPSVGPAttention(
        C,
        H,
        num_inducing=rank,
        features="primal_tokens",
        merge="concat_tokens" if merge == "concat" else "sum",
        shared_posterior=shared,
        sampling="marginal",
        num_outputs="num_inducing",
        max_len=length if max_len is None else max_len,
        ksvd_form=ksvd_form,
        feature_options=options,
    ).to(DTYPE)
    _load_features(layer, params, 1.0 / official_lambda_inverse(params))
    q = layer.strategy._variational_distribution
    with torch.no_grad():
        # m_u[h, :, c] is the mean of output c; every branch of gpattn's q(u) gets it (one when shared)
        q.variational_mean.copy_(params["m_u"].mT.unsqueeze(-2).expand_as(q.variational_mean))
        layer.output_weight.copy_(params["final_weight"].T.expand(H, -1, -1))
        layer.out_proj.weight.copy_(torch.eye(C, dtype=DTYPE))  # the official code skips proj
        layer.out_proj.bias.copy_(params["final_bias"].repeat(H) if merge == "sum" else torch.zeros(C, dtype=DTYPE))
        if merge == "concat":
            layer.token_weight.copy_(params["embed_len_weight"].expand(H, -1, -1))
    return layer


def gpattn_primal(params: dict[str, Tensor], ksvd_form: str = "official") -> PrimalAttention:
    rank, length = params["we"].shape[-1], params["embed_len_weight"].shape[0]
    layer = PrimalAttention(C, H, num_inducing=rank, features="primal_tokens", max_len=length, ksvd_form=ksvd_form).to(
        DTYPE
    )
    _load_features(layer, params, params["primal_lambda"].pow(-2))  # Lambda_param^2 = Lambda^{-1}
    with torch.no_grad():
        layer.output_weight.copy_(params["concate_weight"].T.expand(H, -1, -1))
        layer.out_proj.weight.copy_(params["proj"])
        layer.out_proj.bias.copy_(params["proj"] @ params["concate_bias"].repeat(H) + params["proj_bias"])
    return layer


def _inputs(length: int = N, seed: int = 100) -> Tensor:
    return _randn(B, length, C, seed=seed)


def _ksvd_loss(layer) -> Tensor:
    return dict(layer.features.named_added_loss_terms())["ksvd_loss"].loss()


# -- scores ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "rank,length",
    [(3, N), (1, 13), (5, 4)],
    ids=["all tokens (N' = N)", "evenly sampled (N' = 10 s < N)", "fewer tokens than s (N' = N = 4 < s = 5)"],
)
def test_primal_tokens_scores_are_the_official_ones(rank: int, length: int):
    params = official_parameters(rank, length, seed=1)
    layer = gpattn_kep(params, "sum", shared=True)
    x = _inputs(length)
    scores = layer.features(x, objective=False, kernel_diag=False)
    reference = official_scores(params, x)
    torch.testing.assert_close(scores.left_scores, reference["e"], atol=TOL, rtol=0)
    torch.testing.assert_close(scores.right_scores, reference["r"], atol=TOL, rtol=0)
    we, wr = layer.features.token_primal_weights(x)
    torch.testing.assert_close(we, reference["we"], atol=TOL, rtol=0)
    torch.testing.assert_close(wr, reference["wr"], atol=TOL, rtol=0)
    if length == N:  # the Phi_k(X~)^T W~ variant gives other scores for the same weights
        other = KEPSVGPAttention(C, H, num_inducing=rank, features="primal_features", max_len=N).to(DTYPE)
        _load_features(other, params, 1.0 / official_lambda_inverse(params))
        assert (other.features(x).left_scores - reference["e"]).abs().max() > 1e-2


def test_primal_tokens_padding_mask_zeroes_the_padded_rows():
    params = official_parameters(3, N, seed=2)
    layer = gpattn_kep(params, "sum", shared=True)
    x = _inputs()
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[0, 4:] = False
    masked = layer.features(x, key_mask=mask, objective=False, kernel_diag=False)
    # W_e = X~^T We~ with the padded rows of X~ zeroed; phi_q of the real tokens as without a mask
    we = official_scores(params, x * mask[..., None])["we"]
    q = (x @ params["qk"][:C].T).reshape(B, N, H, HD).permute(0, 2, 1, 3)
    expected = (q / q.norm(dim=-1, keepdim=True)) @ we
    real = mask[:, None, :, None]
    torch.testing.assert_close(masked.left_scores * real, expected * real, atol=TOL, rtol=0)
    # a shorter sequence equals the padded one at its real tokens (row i of W~ belongs to position i)
    short = layer.features(x[:1, :4], objective=False, kernel_diag=False)
    padded = layer.features(x[:1], key_mask=mask[:1], objective=False, kernel_diag=False)
    torch.testing.assert_close(short.left_scores, padded.left_scores[:, :, :4], atol=TOL, rtol=0)


# -- the official CoLA layer: masked q and k, rank_multi = 2 (issue 24, item 7) ------------------------------------
COLA_RANK, COLA_MULTIPLE, COLA_MAX_LEN = 3, 2, 100  # N' = 6 weight rows, sampled from any padded length


def official_cola_scores(params: dict[str, Tensor], x: Tensor, inputs_mask: Tensor) -> dict[str, Tensor]:
    """The official CoLA layer's scores (``KEP_SVGPAttention.gen_weights`` and ``forward(x, inputs_mask)``): X~ = the
    input's channel blocks at ``linspace(0, N - 1, s rank_multi, dtype=int)`` of the **padded** sequence, padded tokens
    included; q and k multiplied by the mask before ``F.normalize`` (a padded token's scores are zero)."""
    batch, length, _ = x.shape
    index = torch.linspace(0, length - 1, params["we"].shape[1], dtype=int)
    sampled = x.reshape(batch, length, H, HD).permute(0, 2, 1, 3)[:, :, index]  # X~_h: (B, H, N', hd)
    we, wr = sampled.mT @ params["we"], sampled.mT @ params["wr"]
    mask = inputs_mask.to(x.dtype)[:, None, :, None]
    q = (x @ params["qk"][:C].T).reshape(batch, length, H, HD).permute(0, 2, 1, 3) * mask
    k = (x @ params["qk"][C:].T).reshape(batch, length, H, HD).permute(0, 2, 1, 3) * mask
    phi_q, phi_k = torch.nn.functional.normalize(q, dim=-1), torch.nn.functional.normalize(k, dim=-1)
    return {"e": phi_q @ we, "r": phi_k @ wr, "we": we, "wr": wr}


def official_cola_mean(params: dict[str, Tensor], x: Tensor, inputs_mask: Tensor) -> Tensor:
    """The official CoLA layer's output with the noise left out: (e + r) Lambda^{-1} m_u, final_weight, (B, N, C)."""
    scores = official_cola_scores(params, x, inputs_mask)
    lam_inv = official_lambda_inverse(params)[None, :, None, :]
    out = ((scores["e"] + scores["r"]) * lam_inv) @ params["m_u"] @ params["final_weight"].T + params["final_bias"]
    return out.permute(0, 2, 1, 3).reshape(x.shape[0], x.shape[1], C)


def _padded_batch(lengths: tuple[int, ...], padded_length: int, seed: int) -> tuple[Tensor, Tensor]:
    """Sequences of ``lengths`` real tokens padded to ``padded_length`` with tokens of their own (as an embedded
    padding token is: not zero), and the mask."""
    x = _randn(len(lengths), padded_length, C, seed=seed)
    mask = torch.arange(padded_length)[None, :] < torch.tensor(lengths)[:, None]
    return x, mask


def _cola_layer(params: dict[str, Tensor], padding: str, ksvd_form: str = "official") -> KEPSVGPAttention:
    options = {"rank_multiple": COLA_MULTIPLE, "padding": padding}
    return gpattn_kep(params, "sum", shared=True, ksvd_form=ksvd_form, max_len=COLA_MAX_LEN, **options)


def test_the_official_cola_layer_is_reproduced_with_its_padding():
    """``feature_options={"rank_multiple": 2, "padding": "included"}`` against the transcription on a padded batch:
    the scores and the mean at the real tokens, zero scores at the padded ones, the official KSVD loss (means over every
    position, the padded scores zero)."""
    params = official_parameters(COLA_RANK, N, seed=11, positions=COLA_RANK * COLA_MULTIPLE)
    x, mask = _padded_batch((9, 5), 9, seed=111)
    layer = _cola_layer(params, "included")
    reference = official_cola_scores(params, x, mask)
    scores = layer.features(x, key_mask=mask, objective=False, kernel_diag=False)
    real = mask[:, None, :, None]
    torch.testing.assert_close(scores.left_scores * real, reference["e"], atol=TOL, rtol=0)
    torch.testing.assert_close(scores.right_scores * real, reference["r"], atol=TOL, rtol=0)
    assert reference["e"][1, :, 5:].abs().max() == 0  # the official code's padded scores are zero
    expected = official_cola_mean(params, x, mask)
    torch.testing.assert_close(layer.eval()(x, mask=mask)[mask], expected[mask], atol=TOL, rtol=0)
    layer.train()(x, mask=mask)
    loss = official_ksvd_loss(
        reference["e"], reference["r"], official_lambda_inverse(params), params["we"], params["wr"]
    )
    torch.testing.assert_close(_ksvd_loss(layer), loss, atol=TOL, rtol=TOL)


def test_without_padding_both_paddings_are_the_official_cola_layer():
    params = official_parameters(COLA_RANK, N, seed=12, positions=COLA_RANK * COLA_MULTIPLE)
    x, mask = _padded_batch((13, 13), 13, seed=112)
    expected = official_cola_mean(params, x, mask)
    for padding in ("included", "excluded"):
        layer = _cola_layer(params, padding).eval()
        torch.testing.assert_close(layer(x), expected, atol=TOL, rtol=0)
        torch.testing.assert_close(layer(x, mask=mask), expected, atol=TOL, rtol=0)


@pytest.mark.parametrize("max_len", [COLA_MAX_LEN, 20], ids=["sampled rows (N' = 2 s)", "one row per position"])
def test_padding_excluded_gives_every_real_token_the_output_of_its_unpadded_sequence(max_len: int):
    """The default ``padding="excluded"``: X~ from the real tokens, so a real token's output (mean, KSVD number) does
    not change with the padding of its batch and is the official layer's on the unpadded sequence."""
    multiple = COLA_MULTIPLE if max_len == COLA_MAX_LEN else 10  # 10 s = 30 > max_len: one row per position
    params = official_parameters(COLA_RANK, N, seed=13, positions=min(max_len, COLA_RANK * multiple))
    layer = gpattn_kep(params, "sum", shared=True, max_len=max_len, rank_multiple=multiple).eval()
    x, _ = _padded_batch((7,), 15, seed=113)
    unpadded = x[:, :7]
    official = official_cola_mean(params, unpadded, torch.ones(1, 7, dtype=torch.bool)) if max_len > 20 else None
    alone = layer(unpadded)
    if official is not None:
        torch.testing.assert_close(alone, official, atol=TOL, rtol=0)
    for padded_length in (8, 11, 15):
        padded, mask = x[:, :padded_length], torch.arange(padded_length)[None, :] < 7
        torch.testing.assert_close(layer(padded, mask=mask)[:, :7], alone, atol=TOL, rtol=0)
        layer.train()
        layer(padded, mask=mask)
        number = _ksvd_loss(layer)
        layer(unpadded)
        torch.testing.assert_close(number, _ksvd_loss(layer), atol=TOL, rtol=TOL)
        layer.eval()
    # and in a batch with sequences of other lengths, each its own
    batch, mask = _padded_batch((7, 3, 15), 15, seed=113)
    for index, length in enumerate((7, 3, 15)):
        together = layer(batch, mask=mask)[index, :length]
        torch.testing.assert_close(together, layer(batch[index : index + 1, :length])[0], atol=TOL, rtol=0)


def test_the_paper_row_does_not_depend_on_padding():
    """``kep_svgp_paper`` with the registry's max_len = 512 (10 s sampled rows): before, a real token's output changed
    with the padded length of its batch (by as much as the output itself)."""
    from gpattn.attention import build_attention

    torch.manual_seed(0)
    layer = build_attention("kep_svgp_paper", C, H, num_inducing=3).to(DTYPE).eval()
    x, _ = _padded_batch((12,), 40, seed=114)
    alone = layer(x[:, :12])
    for padded_length in (13, 25, 40):
        mask = torch.arange(padded_length)[None, :] < 12
        torch.testing.assert_close(layer(x[:, :padded_length], mask=mask)[:, :12], alone, atol=TOL, rtol=0)


def test_padding_included_depends_on_the_padded_length_as_the_official_layer():
    """The official CoLA layer's outputs change with the padding (documented): the transcription and gpattn agree."""
    params = official_parameters(COLA_RANK, N, seed=14, positions=COLA_RANK * COLA_MULTIPLE)
    layer = _cola_layer(params, "included").eval()
    x, _ = _padded_batch((7,), 15, seed=115)
    outputs = []
    for padded_length in (7, 15):
        mask = torch.arange(padded_length)[None, :] < 7
        output = layer(x[:, :padded_length], mask=mask)[:, :7]
        torch.testing.assert_close(
            output, official_cola_mean(params, x[:, :padded_length], mask)[:, :7], atol=TOL, rtol=0
        )
        outputs.append(output)
    assert (outputs[0] - outputs[1]).abs().max() > 1e-2


def test_feature_options_are_checked():
    with pytest.raises(ValueError, match=r"features='amortized' takes no option \['padding'\]; it has none"):
        KEPSVGPAttention(C, H, feature_options={"padding": "included"})
    with pytest.raises(ValueError, match=r"expected padding to be one of \['excluded', 'included'\], got 'all'"):
        KEPSVGPAttention(C, H, features="primal_tokens", max_len=8, feature_options={"padding": "all"})
    with pytest.raises(ValueError, match="expected rank_multiple"):
        PrimalAttention(C, H, features="primal_tokens", max_len=8, feature_options={"rank_multiple": 0})


# -- KEP-SVGP: output mean and KSVD loss ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "merge,shared",
    [("sum", True), ("sum", False), ("concat", True)],
    ids=["sum, shared posterior (official)", "sum, two posteriors with m_e = m_r", "concat (token axis)"],
)
def test_kep_svgp_mean_and_ksvd_loss_are_the_official_ones(merge: str, shared: bool):
    params = official_parameters(3, N, seed=3)
    if merge == "concat":
        params["final_bias"] = torch.zeros(HD, dtype=DTYPE)  # gpattn's token mixing has no per-token bias
    x = _inputs(seed=101)
    reference = official_kep_mean(params, x, concate=merge == "concat")
    for form in ("official", "sum"):
        layer = gpattn_kep(params, merge, shared, ksvd_form=form)
        torch.testing.assert_close(layer.eval()(x), reference, atol=TOL, rtol=0)
        layer.train()
        layer(x)  # a training call refreshes the KSVD penalty
        scores = official_scores(params, x)
        arguments = (scores["e"], scores["r"], official_lambda_inverse(params))
        if form == "official":
            expected = official_ksvd_loss(*arguments, params["we"], params["wr"])
        else:
            expected = sum_form_ksvd_loss(*arguments, scores["we"], scores["wr"])
        torch.testing.assert_close(_ksvd_loss(layer), expected, atol=TOL, rtol=TOL)


def test_the_two_ksvd_forms_differ():
    params = official_parameters(3, N, seed=4)
    x = _inputs(seed=102)
    scores = official_scores(params, x)
    arguments = (scores["e"], scores["r"], official_lambda_inverse(params))
    official = official_ksvd_loss(*arguments, params["we"], params["wr"])
    summed = sum_form_ksvd_loss(*arguments, scores["we"], scores["wr"])
    assert not math.isclose(float(official), float(summed), rel_tol=0.1)


def test_official_ksvd_form_needs_primal_tokens():
    with pytest.raises(ValueError, match="ksvd_form='official'.*primal_tokens"):
        KEPSVGPAttention(C, H, num_inducing=3, ksvd_form="official")
    with pytest.raises(ValueError, match="ksvd_form"):
        PrimalAttention(C, H, num_inducing=3, features="primal_tokens", max_len=N, ksvd_form="mean")
    with pytest.raises(ValueError, match="feature_dim must be embed_dim / num_heads"):
        KEPSVGPAttention(C, H, num_inducing=3, features="primal_tokens", max_len=N, feature_dim=4)


# -- Primal-Attention ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("form", ["official", "sum"])
def test_primal_attention_output_and_ksvd_loss_are_the_official_ones(form: str):
    params = official_parameters(3, N, seed=5)
    layer = gpattn_primal(params, ksvd_form=form)
    x = _inputs(seed=103)
    torch.testing.assert_close(layer.eval()(x), official_primal_output(params, x), atol=TOL, rtol=0)
    layer.train()(x)
    scores = official_scores(params, x)
    arguments = (scores["e"], scores["r"], params["primal_lambda"].pow(2))
    if form == "official":
        expected = official_ksvd_loss(*arguments, params["we"], params["wr"])
    else:
        expected = sum_form_ksvd_loss(*arguments, scores["we"], scores["wr"])
    torch.testing.assert_close(_ksvd_loss(layer), expected, atol=TOL, rtol=TOL)


# -- the official KL defect ----------------------------------------------------------------------------------------
def official_covariance_factors(params: dict[str, Tensor]) -> Tensor:
    """``s_sqrt_local`` of the official code, shape (H, s, s, s):
    L[h, a, i, j] = exp(log_ssqrt)[h, a, i] [i = j] + tril(raw, -1)[h, a, i, j]."""
    return torch.diag_embed(params["log_ssqrt"].exp()) + params["s_sqrt_low_triangle"].tril(-1)


def official_kl(params: dict[str, Tensor]) -> Tensor:
    """The official KL, its five terms transcribed (Lambda^{-1/2} = exp(log_lambda_sqrt_inv), d = s outputs)."""
    rank = params["m_u"].shape[-1]
    factors = official_covariance_factors(params)  # (H, a, i, j)
    lam_inv = official_lambda_inverse(params)  # (H, s)
    trace = 0.5 * (lam_inv[:, :, None, None] * factors).pow(2).sum()  # ||Lambda^{-1} L[:, :, :, j]||_F^2 over j
    mean = 0.5 * (params["m_u"].pow(2) * lam_inv.pow(2)[:, :, None]).sum()  # m_c^T Lambda^{-2} m_c
    log_det_s = params["log_ssqrt"].sum()
    log_det_prior = 0.5 * 4 * params["log_lambda_sqrt_inv"].sum() * rank
    return trace + mean - log_det_s - log_det_prior - 0.5 * rank * rank * params["m_u"].shape[0]


def sampled_covariances(params: dict[str, Tensor]) -> Tensor:
    """The covariance of u that the official sampling draws for output c: M_c M_c^T with M_c[a, i] = L[a, i, c] (its
    noise ``v1 @ L.permute(.., j, a, i) @ eps``), shape (H, d, s, s)."""
    factors = official_covariance_factors(params).permute(0, 3, 1, 2)  # (H, c, a, i)
    return factors @ factors.mT


def intended_posteriors(params: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """The posterior the official KL's log-determinant reads: output a has the triangular factor L[h, a]; means
    (H, d, s) and factors (H, d, s, s)."""
    return params["m_u"].mT, official_covariance_factors(params)


def kl_defect_numbers(num_heads: int = H, rank: int = 3, seed: int = 6) -> dict[str, object]:
    """The numbers of the docs table (docs/guide/papers.md) for official-style initial weights."""
    gen = torch.Generator().manual_seed(seed)
    params = {
        "log_lambda_sqrt_inv": torch.rand(num_heads, rank, generator=gen, dtype=DTYPE),  # official: uniform
        "m_u": torch.randn(num_heads, rank, rank, generator=gen, dtype=DTYPE),  # official: normal
        "s_sqrt_low_triangle": torch.randn(num_heads, rank, rank, rank, generator=gen, dtype=DTYPE),
        "log_ssqrt": torch.randn(num_heads, rank, rank, generator=gen, dtype=DTYPE),
    }
    lam = 1.0 / official_lambda_inverse(params)
    covariances = sampled_covariances(params)
    ranks = torch.linalg.matrix_rank(covariances)  # (H, d)
    # the dense KL of what is sampled: log|S_c| = -inf for a rank-deficient S_c (numerical rank below s)
    _, log_det = torch.linalg.slogdet(covariances)
    inverse_prior = lam.pow(-2)[:, None, :]
    means = params["m_u"].mT
    sampled_kl = 0.5 * (
        (covariances.diagonal(dim1=-2, dim2=-1) * inverse_prior).sum(-1)
        + (means.pow(2) * inverse_prior).sum(-1)
        - rank
        + lam.pow(2).log().sum(-1)[:, None]
        - torch.where(ranks == rank, log_det, torch.full_like(log_det, -math.inf))
    )
    intended_mean, intended_factor = intended_posteriors(params)
    q = torch.distributions.MultivariateNormal(intended_mean, scale_tril=intended_factor)
    prior = torch.distributions.MultivariateNormal(
        torch.zeros(num_heads, 1, rank, dtype=DTYPE), torch.diag_embed(lam.pow(2))[:, None]
    )
    intended = torch.distributions.kl_divergence(q, prior).sum()
    return {
        "ranks": ranks,
        "sampled_kl": sampled_kl,
        "official_kl": official_kl(params),
        "intended_kl": intended,
        "params": params,
    }


def test_official_kl_defect():
    rank = 3
    numbers = kl_defect_numbers(rank=rank)
    # the official sampling's covariance for output c (from 0) has rank s - c: only output 0 has a density
    expected_ranks = torch.tensor([rank - c for c in range(rank)]).expand(H, -1)
    assert torch.equal(numbers["ranks"], expected_ranks)
    assert torch.isfinite(numbers["sampled_kl"][:, 0]).all()
    assert torch.isinf(numbers["sampled_kl"][:, 1:]).all() and (numbers["sampled_kl"][:, 1:] > 0).all()
    # the official number is neither the (infinite) KL of what is sampled nor the KL of the triangular posterior
    # its log-determinant reads
    official, intended = float(numbers["official_kl"]), float(numbers["intended_kl"])
    assert math.isfinite(official) and abs(official - intended) > 1e-3 * abs(intended)

    # gpattn holding that triangular posterior: its KL is torch.distributions' for the covariance it samples from
    params = {**official_parameters(rank, N, seed=7), **numbers["params"]}
    layer = gpattn_kep(params, "sum", shared=True)
    mean, factor = intended_posteriors(params)
    with torch.no_grad():
        layer.strategy._variational_distribution.chol_variational_covar.copy_(factor.unsqueeze(-3))
    torch.testing.assert_close(layer.kl_divergence(), numbers["intended_kl"], atol=TOL, rtol=TOL)
    # ... and the covariance it samples from is L_c L_c^T: the predictive variance it reports (exact) and the
    # marginal samples (Monte Carlo) agree with (e + r) Lambda^{-1} L_c L_c^T Lambda^{-1} (e + r)^T through the maps
    x = _inputs(seed=104)
    scores = official_scores(params, x)
    interp = (scores["e"] + scores["r"]) * official_lambda_inverse(params)[None, :, None, :]  # (B, H, N, s)
    roots = torch.einsum("bhns,hcst->bhcnt", interp, factor)  # per output c: (B, H, d, N, s)
    head_variance = torch.einsum("bhcnt,cj->bhnj", roots.pow(2), params["final_weight"].T.pow(2))
    dense_variance = head_variance.permute(0, 2, 1, 3).reshape(B, N, C)
    _, variance = layer.posterior(x)
    torch.testing.assert_close(variance, dense_variance, atol=TOL, rtol=TOL)
    layer.train()
    torch.manual_seed(0)
    with torch.no_grad():  # 4000 copies of the batch in one call: independent marginal draws per sequence and token
        draws = layer(x.repeat(4000, 1, 1)).unflatten(0, (4000, B))
    torch.testing.assert_close(draws.var(0), dense_variance, rtol=0.15, atol=1e-3)
