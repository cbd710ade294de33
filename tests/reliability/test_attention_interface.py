"""The attention layers as a transformer user drops them into a model: every registered attention
(:func:`~gpattn.attention.attention_names`) against what its docstrings and docs/guide/attention.md promise, with
independent references.

* a dense float64 re-computation of every layer's mean path from its parameters (:func:`dense_reference`: the
  formulas of the layers' docstrings, one sequence of real tokens at a time, with explicit kernel matrices and
  solves), against padded batches of sequences of different lengths: padding changes no real token's output;
* the ``softmax`` row against :class:`torch.nn.MultiheadAttention` with weights copied by
  :func:`~gpattn.integrations.copy_projections`;
* masks (the convention ``True`` = real token, bool / float / int masks, one real token, masks of the wrong shape or
  device, causal masks against the prefix alone, what the padding holds), shapes (batch 1, length 1, longer sequences
  after a training step, non-contiguous inputs, ``embed_dim`` not divisible by the heads), gradients (padded inputs
  get none; double backward works or is refused clearly), modes (eval determinism, ``torch.no_grad``, train against
  eval, Monte Carlo samples against :meth:`posterior`, :func:`~gpattn.attention.sample_attention`,
  ``torch.autocast("cpu", torch.bfloat16)``), state (``state_dict`` into a fresh layer, ``torch.save``, deepcopy,
  ``.to(torch.float64)``), and the integrations' mask readers.

Layers are small (``embed_dim=16``, 2 heads, inducing / rank sizes 4) and in float64 unless a test says otherwise.
A test marked ``xfail(strict=True)`` asserts the right behaviour and records a defect named in its reason.
"""

from __future__ import annotations

import copy
import io
import math

import gpytorch
import pytest
import torch
from torch import Tensor

from gpattn.attention import AttentionLayer, attention_names, build_attention, sample_attention, select_arguments
from gpattn.integrations import copy_projections, padding_mask

EMBED_DIM, NUM_HEADS = 16, 2
HEAD_DIM = EMBED_DIM // NUM_HEADS
NAMES = attention_names()
DTYPE = torch.float64


def build(name: str, dtype: torch.dtype = DTYPE, seed: int = 0, **kwargs) -> AttentionLayer:
    """A small registry layer (inducing / rank sizes 4 where it has them), seeded, in ``dtype``, in eval mode."""
    torch.manual_seed(seed)
    layer = build_attention(name, EMBED_DIM, NUM_HEADS, **{**select_arguments(name, num_inducing=4), **kwargs})
    return layer.to(dtype).eval()


def tokens(batch: int, length: int, seed: int = 1, dtype: torch.dtype = DTYPE, width: int = EMBED_DIM) -> Tensor:
    return torch.randn(batch, length, width, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def padded_batch(
    lengths: list[int], length: int, seed: int = 10, fill: float = 3.0
) -> tuple[list[Tensor], Tensor, Tensor]:
    """Sequences of the given lengths ``(1, n, C)``, the batch that holds them left-aligned ``(B, length, C)`` with
    ``fill`` times random tokens in its padding, and its mask (``True`` = real token)."""
    sequences = [tokens(1, n, seed=seed + i) for i, n in enumerate(lengths)]
    batch = fill * tokens(len(lengths), length, seed=seed - 1)
    for i, sequence in enumerate(sequences):
        batch[i, : sequence.shape[1]] = sequence[0]
    mask = torch.arange(length) < torch.tensor(lengths)[:, None]
    return sequences, batch, mask


def mha_pair(seed: int = 0) -> tuple[AttentionLayer, torch.nn.MultiheadAttention]:
    """A float64 ``softmax`` layer and an independently built :class:`torch.nn.MultiheadAttention` whose projections it
    takes through :func:`copy_projections`."""
    torch.manual_seed(seed + 100)
    reference = torch.nn.MultiheadAttention(EMBED_DIM, NUM_HEADS, batch_first=True, dtype=DTYPE).eval()
    with torch.no_grad():  # non-zero biases, so that a dropped bias shows
        reference.in_proj_bias.normal_()
        reference.out_proj.bias.normal_()
    layer = build("softmax", seed=seed)
    weights = reference.in_proj_weight.chunk(3)
    biases = reference.in_proj_bias.chunk(3)
    projections = {role: (weights[i], biases[i]) for i, role in enumerate(("query", "key", "value"))}
    projections["output"] = (reference.out_proj.weight, reference.out_proj.bias)
    copied = copy_projections(layer, projections)
    expected = tuple(
        f"{name}.{part}" for name in ("q_proj", "k_proj", "v_proj", "out_proj") for part in ("weight", "bias")
    )
    assert copied == expected
    return layer, reference


# -- the dense reference -------------------------------------------------------------------------------------------
def _rbf(left: Tensor, right: Tensor, lengthscale: Tensor | float = 1.0, scale: Tensor | float = 1.0) -> Tensor:
    difference = (left[:, None, :] - right[None, :, :]) / lengthscale
    return scale * torch.exp(-0.5 * difference.square().sum(-1))


def _unit(vectors: Tensor) -> Tensor:
    return vectors / vectors.norm(dim=-1, keepdim=True)


def _kernel_eigen_scores(layer: AttentionLayer, x: Tensor, head: int) -> tuple[Tensor, Tensor]:
    r"""The scores :math:`e, r` of one head for one sequence ``x`` (``(N, C)``): :math:`e(x) = \phi_q(x)^\top W_{e|X}`
    with the cosine features :math:`\phi = \sqrt{\sigma_f} W x / \|W x\|` and the weights of the feature mode."""
    features = layer.features
    kernel = features.kernel
    root = kernel.outputscale[head].sqrt()
    query_features = root * _unit(x @ kernel.query_weight[head].T)  # (N, p)
    key_features = root * _unit(x @ kernel.key_projection[head].T)
    length = x.shape[0]
    if features.mode == "amortized":  # e(x) = kappa(x, Z) A_e(Z) / M, r(z) = kappa(X, z)^T A_r(X) / N
        left_values = x @ features.left_map[head] + features.left_bias[head]
        right_values = left_values if features.tie_qk else x @ features.right_map[head] + features.right_bias[head]
        gram = query_features @ key_features.T
        return gram @ left_values / length, gram.T @ right_values / length
    assert features.mode == "primal_tokens"  # W_e|X = X~_h^T W~_e with N' = min(max_len, 10 s) (evenly spaced) rows
    rows = features.left_token_weights.shape[1]
    if rows == features.max_len:  # one row per position
        positions, left_rows, right_rows = (
            torch.arange(length),
            features.left_token_weights[head, :length],
            features.right_token_weights[head, :length],
        )
    else:
        positions = torch.linspace(0, length - 1, rows, dtype=torch.long)
        left_rows, right_rows = features.left_token_weights[head], features.right_token_weights[head]
    head_tokens = x[positions][:, head * HEAD_DIM : (head + 1) * HEAD_DIM]  # X~_h: (N', p)
    return query_features @ (head_tokens.T @ left_rows), key_features @ (head_tokens.T @ right_rows)


def dense_reference(layer: AttentionLayer, x: Tensor) -> Tensor:
    """The eval-mode output (the predictive mean) of ``layer`` for one sequence ``x`` of real tokens, ``(N, C)``,
    recomputed in the layer's dtype from its parameters with explicit matrices and solves (no gpattn code)."""
    kind = type(layer).__name__
    heads: list[Tensor] = []
    block = [slice(h * HEAD_DIM, (h + 1) * HEAD_DIM) for h in range(NUM_HEADS)]
    eye = torch.eye(x.shape[0], dtype=x.dtype)
    with torch.no_grad():
        if kind == "SoftmaxAttention":  # softmax(Q K^T / sqrt(p)) V per head
            queries, keys, values = (linear(x) for linear in (layer.q_proj, layer.k_proj, layer.v_proj))
            for s in block:
                weights = torch.softmax(queries[:, s] @ keys[:, s].T / math.sqrt(HEAD_DIM), dim=-1)
                heads.append(weights @ values[:, s])
        elif kind == "SGPAAttention":  # K_qg v_g - K_qb K_bb^-1 K_bg v_g + K_qb v_b, K_bb + jitter mean(diag) I
            keys, values = x @ layer.key_proj.weight.T, x @ layer.value_proj.weight.T
            for h, s in enumerate(block):
                lengthscale, scale = layer.lengthscale[h], layer.outputscale[h]
                inducing_keys, inducing_values = layer.inducing_keys[h], layer.inducing_values[h]
                induc = _rbf(inducing_keys, inducing_keys, lengthscale, scale)
                induc = induc + layer.jitter * induc.diagonal().mean() * torch.eye(len(induc), dtype=x.dtype)
                cross = _rbf(keys[:, s], inducing_keys, lengthscale, scale)  # K_qb = K_gb (self-attention)
                amortised = _rbf(keys[:, s], keys[:, s], lengthscale, scale) @ values[:, s]
                heads.append(
                    amortised - cross @ torch.linalg.solve(induc, cross.T @ values[:, s]) + cross @ inducing_values
                )
        elif kind == "SymmetricSVGPAttention":  # whitened SVGP mean K_zu L^-T m at z = W_q x + mean_j W_k x_j
            inputs = x @ layer.query_proj.weight.T + (x @ layer.key_proj.weight.T).mean(0, keepdim=True)
            strategy = layer.gp.variational_strategy
            jitter = gpytorch.settings.variational_cholesky_jitter.value(x.dtype)
            for h, s in enumerate(block):
                lengthscale = layer.gp.covar_module.base_kernel.lengthscale[h, 0, 0]
                scale = layer.gp.covar_module.outputscale[h, 0]
                inducing = strategy.inducing_points[h, 0]
                factor = torch.linalg.cholesky(
                    _rbf(inducing, inducing, lengthscale, scale) + jitter * torch.eye(len(inducing), dtype=x.dtype)
                )
                interp = torch.linalg.solve_triangular(
                    factor, _rbf(inducing, inputs[:, s], lengthscale, scale), upper=False
                )
                heads.append(interp.T @ strategy._variational_distribution.variational_mean[h].T)
        elif kind == "CGPTAttention":  # K_q0 (K_00 + eps I)^-1 K_0k v with the standardised RBF kernel
            queries, keys = x @ layer.query_proj.weight.T, x @ layer.key_proj.weight.T
            latents, values = x @ layer.latent_proj.weight.T, x @ layer.value_proj.weight.T
            for s in block:
                latent = _rbf(latents[:, s], latents[:, s]) + layer.jitter * eye
                heads.append(
                    _rbf(queries[:, s], latents[:, s])
                    @ torch.linalg.solve(latent, _rbf(latents[:, s], keys[:, s]) @ values[:, s])
                )
        elif kind == "PrimalAttention":  # [e, r] W_o per head
            for h in range(NUM_HEADS):
                left, right = _kernel_eigen_scores(layer, x, h)
                heads.append(torch.cat([left, right], -1) @ layer.output_weight[h])
        elif kind == "KEPSVGPAttention":  # (e Lambda^-1 m_e + r Lambda^-1 m_r) W_h (or (e + r) Lambda^-1 m shared)
            singular_values = layer.features.singular_values
            means = layer.strategy._variational_distribution.variational_mean
            for h in range(NUM_HEADS):
                left, right = _kernel_eigen_scores(layer, x, h)
                left, right, mean = left / singular_values[h], right / singular_values[h], means[h]
                if layer.tie_qk:  # one branch
                    outputs = left @ mean.T
                elif layer.shared_posterior:
                    outputs = (left + right) @ mean[:, 0].T
                else:
                    outputs = left @ mean[:, 0].T + right @ mean[:, 1].T
                heads.append(outputs @ layer.output_weight[h])
        else:
            raise NotImplementedError(kind)
        return torch.cat(heads, -1) @ layer.out_proj.weight.T + layer.out_proj.bias


# -- mean path and padding -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_mean_path_matches_a_dense_float64_reference(name):
    # a batch of sequences of lengths 6, 2 and 4 padded to 7: every real token's output is the dense reference of its
    # sequence alone (so padding changes nothing), and the layer on each sequence alone is that reference too
    layer = build(name)
    sequences, batch, mask = padded_batch([6, 2, 4], 7)
    output = layer(batch, mask=mask)
    assert output.shape == (3, 7, EMBED_DIM) and output.dtype == DTYPE
    assert torch.isfinite(output).all()  # padded query positions: unspecified, but finite (they are only ignored)
    for i, sequence in enumerate(sequences):
        expected = dense_reference(layer, sequence[0])
        assert expected.abs().max() > 1e-2  # not a vacuous comparison
        torch.testing.assert_close(output[i, mask[i]], expected, rtol=0, atol=1e-12)
        torch.testing.assert_close(layer(sequence)[0], expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", NAMES)
def test_what_the_padding_holds_does_not_reach_the_real_tokens(name):
    # padding "may hold anything finite": a padded position set to 1e4 (a sentinel value, uninitialised memory) must
    # leave the real tokens' outputs as they are alone, here in float32
    layer = build(name, dtype=torch.float32).requires_grad_(False)
    x = tokens(2, 6, dtype=torch.float32)
    mask = torch.tensor([[True] * 6, [True] * 3 + [False] * 3])
    alone = layer(x[1:, :3])[0]
    padded = x.clone()
    padded[1, 3:] = 1e4
    output = layer(padded, mask=mask)[1, :3]
    assert float((output - alone).abs().max() / alone.abs().max()) < 1e-4


@pytest.mark.parametrize("name", [name for name in NAMES if build(name).supports_cross_attention])
def test_what_padded_context_holds_does_not_reach_the_outputs(name):
    layer = build(name, dtype=torch.float32).requires_grad_(False)
    x, context = tokens(1, 4, dtype=torch.float32), tokens(1, 6, seed=2, dtype=torch.float32)
    mask = torch.tensor([[True] * 3 + [False] * 3])
    alone = layer(x, context=context[:, :3])
    padded = context.clone()
    padded[0, 3:] = 1e4
    output = layer(x, mask=mask, context=padded)
    assert float((output - alone).abs().max() / alone.abs().max()) < 1e-4


def test_sgpa_exponential_kernel_takes_a_batch_whatever_its_padding_holds():
    layer = build("sgpa", dtype=torch.float32, kernel="exponential")
    x = tokens(2, 6, dtype=torch.float32)
    mask = torch.tensor([[True] * 6, [True] * 3 + [False] * 3])
    alone = layer(x[1:, :3])[0]
    padded = x.clone()
    padded[1, 3:] = 10.0
    torch.testing.assert_close(layer(padded, mask=mask)[1, :3], alone, rtol=0, atol=1e-5)


# -- masks ---------------------------------------------------------------------------------------------------------
def test_softmax_equals_multihead_attention_with_copied_projections():
    # copy_projections from nn.MultiheadAttention: equal to 1e-12 in float64 at every position (MHA's
    # key_padding_mask hides keys only, as gpattn's mask does), self- and cross-attention, padding and causal masks
    layer, reference = mha_pair()
    x, context = tokens(3, 6), tokens(3, 9, seed=2)
    real = torch.arange(6) < torch.tensor([6, 1, 4])[:, None]
    context_real = torch.arange(9) < torch.tensor([2, 9, 5])[:, None]
    future = torch.ones(6, 6, dtype=torch.bool).triu(1)  # nn.MultiheadAttention: True = may NOT attend
    cases = [
        (layer(x), reference(x, x, x, need_weights=False)[0]),
        (layer(x, mask=real), reference(x, x, x, key_padding_mask=~real, need_weights=False)[0]),
        (layer(x, mask="causal"), reference(x, x, x, attn_mask=future, need_weights=False)[0]),
        (layer(x, context=context), reference(x, context, context, need_weights=False)[0]),
        (
            layer(x, mask=context_real, context=context),
            reference(x, context, context, key_padding_mask=~context_real, need_weights=False)[0],
        ),
    ]
    for actual, expected in cases:
        torch.testing.assert_close(actual, expected, rtol=0, atol=1e-12)


def test_the_padding_mask_convention_is_true_for_real_tokens():
    # gpattn's mask is the inverse of nn.MultiheadAttention's key_padding_mask (True = pad): the real tokens' outputs
    # equal MHA's with ~mask, and MHA's own mask passed as it is reads the padding as the sequence
    layer, reference = mha_pair()
    x = tokens(2, 5)
    real = torch.tensor([[True, True, True, False, False], [True, True, False, False, False]])
    expected = reference(x, x, x, key_padding_mask=~real, need_weights=False)[0]
    torch.testing.assert_close(layer(x, mask=real)[real], expected[real], rtol=0, atol=1e-12)
    assert (layer(x, mask=~real)[real] - expected[real]).abs().max() > 1e-2
    # a batch without padding: MHA's all-False mask hides every token in gpattn's convention, which is refused
    with pytest.raises(ValueError, match=r"hides every token of sequence\(s\) \[0, 1\]"):
        layer(x, mask=torch.zeros(2, 5, dtype=torch.bool))


@pytest.mark.parametrize("name", NAMES)
def test_masks_of_another_dtype_shape_or_device_are_refused_clearly(name):
    layer = build(name)
    x = tokens(2, 5)
    real = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    for wrong in (real.double(), real.long(), real.to(torch.uint8)):  # no silent reading of 0/1 or additive masks
        with pytest.raises(TypeError, match=r"boolean padding mask \(True = real token\), got torch\."):
            layer(x, mask=wrong)
    with pytest.raises(TypeError, match="got list"):
        layer(x, mask=real.tolist())
    for wrong in (real[:, None, :], real[0], real[:, :4], torch.ones(5, 2, dtype=torch.bool)):
        with pytest.raises(ValueError, match=r"padding mask of shape \(2, 5\) = \(batch, keys\), got"):
            layer(x, mask=wrong)
    with pytest.raises(ValueError, match="mask is on meta but the tokens are on cpu"):
        layer(x, mask=real.to("meta"))
    with pytest.raises(ValueError, match=r"hides every token of sequence\(s\) \[1\]"):
        layer(x, mask=torch.tensor([[True] * 5, [False] * 5]))
    # a non-contiguous mask reads as its contiguous copy
    transposed = real.T.contiguous().T
    assert not transposed.is_contiguous()
    torch.testing.assert_close(layer(x, mask=transposed), layer(x, mask=real), rtol=0, atol=0)


@pytest.mark.parametrize("name", NAMES)
def test_one_real_token_in_the_middle_is_that_token_alone(name):
    layer = build(name)
    x = tokens(2, 5)
    real = torch.zeros(2, 5, dtype=torch.bool)
    real[:, 2] = True
    output = layer(x, mask=real)
    assert torch.isfinite(output).all()
    torch.testing.assert_close(output[:, 2], dense_reference_batch(layer, x[:, 2:3])[:, 0], rtol=0, atol=1e-12)


def dense_reference_batch(layer: AttentionLayer, x: Tensor) -> Tensor:
    return torch.stack([dense_reference(layer, sequence) for sequence in x])


@pytest.mark.parametrize("name", NAMES)
def test_causal_output_is_the_output_of_the_prefix_alone(name):
    layer = build(name)
    x = tokens(2, 6)
    if not layer.supports_causal:
        with pytest.raises(ValueError, match="does not support causal masks"):
            layer(x, mask="causal")
        return
    output = layer(x, mask="causal")
    for i in range(6):
        torch.testing.assert_close(output[:, i], layer(x[:, : i + 1])[:, i], rtol=0, atol=1e-12)
    torch.testing.assert_close(output[:, -1], dense_reference_batch(layer, x)[:, -1], rtol=0, atol=1e-12)


# -- shapes --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_batch_one_and_length_one(name):
    layer = build(name)
    for shape in ((1, 1), (1, 5), (4, 1)):
        x = tokens(*shape)
        torch.testing.assert_close(layer(x), dense_reference_batch(layer, x), rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", NAMES)
def test_sequences_longer_than_in_training(name):
    # a training step on sequences of 6 tokens, then eval on 40: the dense reference of the updated parameters
    layer = build(name).train()
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.05)
    torch.manual_seed(3)
    output = layer(tokens(4, 6))
    loss = output.square().mean() + layer.kl_divergence() / 100
    loss = loss + sum((term.loss() for term in layer.added_loss_terms()), torch.zeros((), dtype=DTYPE))
    loss.backward()
    optimizer.step()
    layer.eval()
    x = tokens(2, 40, seed=5)
    torch.testing.assert_close(layer(x), dense_reference_batch(layer, x), rtol=0, atol=1e-11)


def test_positional_weights_refuse_longer_sequences_clearly():
    # the paper rows with one weight row per position (max_len <= 10 s) cannot take a longer sequence: a clear error
    for name in ("kep_svgp_paper", "primal_paper"):
        layer = build(name, max_len=8)
        assert layer(tokens(1, 8)).shape == (1, 8, EMBED_DIM)
        with pytest.raises(ValueError, match="sequences of at most max_len=8 tokens, got 9"):
            layer(tokens(1, 9))


@pytest.mark.parametrize("name", NAMES)
def test_embed_dim_not_divisible_by_the_heads_is_refused_clearly(name):
    with pytest.raises(ValueError, match=r"embed_dim \(18\) must be divisible by num_heads \(4\)"):
        build_attention(name, 18, 4)
    with pytest.raises(ValueError, match="expected num_heads to be a positive integer, got 0"):
        build_attention(name, 16, 0)


@pytest.mark.parametrize("name", NAMES)
def test_non_contiguous_inputs_give_the_contiguous_outputs(name):
    layer = build(name)
    real = torch.tensor([[True] * 5, [True] * 2 + [False] * 3, [True] * 4 + [False]])
    views = {
        "transposed batch": tokens(5, 3).transpose(0, 1),
        "strided channels": tokens(3, 5, width=2 * EMBED_DIM)[..., ::2],
        "expanded batch": tokens(1, 5).expand(3, 5, EMBED_DIM),
    }
    for what, x in views.items():
        assert not x.is_contiguous(), what
        torch.testing.assert_close(layer(x, mask=real), layer(x.contiguous(), mask=real), rtol=0, atol=0, msg=what)


# -- gradients -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_padded_inputs_get_no_gradient(name, mode):
    layer = build(name).train(mode == "train")
    x = tokens(2, 5).requires_grad_(True)
    real = torch.tensor([[True] * 5, [True] * 2 + [False] * 3])
    torch.manual_seed(4)
    (layer(x, mask=real)[real].square().sum()).backward()
    assert torch.isfinite(x.grad).all()
    assert x.grad[~real].abs().max() < 1e-15
    assert x.grad[real].abs().min(dim=-1).values.max() > 0


@pytest.mark.parametrize("name", NAMES)
def test_double_backward_is_right_or_refused_clearly(name):
    torch.manual_seed(0)
    layer = build_attention(name, 8, 2, **select_arguments(name, num_inducing=2)).to(DTYPE).eval()
    x = tokens(2, 3, width=8).requires_grad_(True)
    real = torch.tensor([[True] * 3, [True, True, False]])
    try:
        passed = torch.autograd.gradgradcheck(
            lambda inputs: layer(inputs, mask=real), (x,), eps=1e-6, atol=1e-5, check_undefined_grad=False
        )
    except RuntimeError as error:  # refused: gpattn's fused functions, or torch's fused CPU attention kernel
        assert "second derivatives are not implemented" in str(error) or "is not implemented" in str(error)
    else:
        assert passed


# -- modes ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_eval_is_deterministic_and_no_grad_changes_nothing(name):
    layer = build(name)
    x = tokens(2, 6)
    real = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    first = layer(x, mask=real)
    assert first.requires_grad
    torch.testing.assert_close(layer(x, mask=real), first, rtol=0, atol=0)
    with torch.no_grad():
        quiet = layer(x, mask=real)
    assert not quiet.requires_grad
    torch.testing.assert_close(quiet, first, rtol=0, atol=1e-14)
    mean, variance = layer.posterior(x, mask=real)
    torch.testing.assert_close(mean, first, rtol=0, atol=1e-14)
    assert (variance >= 0).all() and (layer.is_stochastic or torch.count_nonzero(variance) == 0)


@pytest.mark.parametrize("name", NAMES)
def test_training_mode_against_eval_mode(name):
    # deterministic layers (no dropout): training and eval outputs are the same; stochastic layers: a sample in
    # training, whose Monte Carlo mean and variance over 4000 sequences are posterior()'s (4.5 standard errors; 15 %)
    layer = build(name)
    x = tokens(1, 5)
    mean, variance = layer.posterior(x)
    if not layer.is_stochastic:
        torch.testing.assert_close(layer.train()(x), layer.eval()(x), rtol=0, atol=0)
        return
    draws = 4000
    with torch.no_grad():
        torch.manual_seed(1)
        samples = layer.train()(x.expand(draws, -1, -1))
    assert layer.training  # posterior() left the mode alone
    error = (samples.mean(0) - mean[0]) / (variance[0] / draws).sqrt()
    assert error.abs().max() < 4.5
    ratio = samples.var(0) / variance[0]
    assert ratio.min() > 0.85 and ratio.max() < 1.15
    torch.testing.assert_close(layer.posterior(x)[0], mean, rtol=0, atol=0)


@pytest.mark.parametrize("name", NAMES)
def test_sample_attention_samples_in_eval_and_restores(name):
    layer = build(name)
    x = tokens(2, 5)
    mean = layer(x)
    with sample_attention(layer):
        first, second = layer(x), layer(x)
    torch.testing.assert_close(layer(x), mean, rtol=0, atol=0)
    if layer.is_stochastic:
        assert (first - second).abs().max() > 1e-6 and (first - mean).abs().max() > 1e-6
    else:
        torch.testing.assert_close(first, mean, rtol=0, atol=0)
        torch.testing.assert_close(second, mean, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="inside"), sample_attention(layer):
        raise RuntimeError("inside")
    assert not layer.sample_in_eval
    torch.testing.assert_close(layer(x), mean, rtol=0, atol=0)


@pytest.mark.parametrize("name", NAMES)
def test_bfloat16_autocast_is_finite_and_close_to_float32(name):
    layer = build(name, dtype=torch.float32)
    x = tokens(2, 8, dtype=torch.float32)
    real = torch.tensor([[True] * 8, [True] * 5 + [False] * 3])
    masks = [real, "causal"] if layer.supports_causal else [real]
    for mask in masks:
        reference = layer(x, mask=mask)
        with torch.autocast("cpu", torch.bfloat16):
            output = layer(x, mask=mask)
        assert output.dtype == torch.bfloat16 and torch.isfinite(output).all()
        keep = real if mask is real else torch.ones_like(real)
        error = (output.float() - reference)[keep].norm() / reference[keep].norm()
        assert error < 3e-2, (mask if isinstance(mask, str) else "padding", float(error))


@pytest.mark.parametrize("name", ["softmax", "kep_svgp"])
def test_a_float64_input_to_a_float32_layer_under_autocast_is_refused_clearly(name):
    layer = build(name, dtype=torch.float32)
    with torch.autocast("cpu", torch.bfloat16), pytest.raises(TypeError, match="x is torch.float64"):
        layer(tokens(2, 5))


@pytest.mark.parametrize("name", ["softmax", "kep_svgp"])
def test_autocast_mixes_float32_and_bfloat16_but_refuses_float64_either_way(name):
    # float32 tokens into a bfloat16 layer (and bfloat16 tokens into a float32 one) are autocast's own mixing: they
    # pass the check and run; float32 tokens into a float64 layer would fail deep inside (autocast casts no float64)
    x = tokens(2, 5, dtype=torch.float32)
    with torch.autocast("cpu", torch.bfloat16):
        assert torch.isfinite(build(name, dtype=torch.bfloat16)(x)).all()
        assert torch.isfinite(build(name, dtype=torch.float32)(x.bfloat16())).all()
        with pytest.raises(TypeError, match="x is torch.float32 but the parameters are torch.float64"):
            build(name, dtype=torch.float64)(x)


# -- state ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_state_dict_save_and_deepcopy_give_identical_outputs(name):
    layer = build(name)
    with torch.no_grad():  # parameters away from their initial values
        generator = torch.Generator().manual_seed(7)
        for parameter in layer.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, dtype=DTYPE, generator=generator))
    x = tokens(2, 6)
    real = torch.tensor([[True] * 6, [True] * 3 + [False] * 3])
    expected = layer(x, mask=real)
    fresh = build(name, seed=11)
    assert (fresh(x, mask=real) - expected).abs().max() > 1e-6
    fresh.load_state_dict(layer.state_dict())
    torch.testing.assert_close(fresh(x, mask=real), expected, rtol=0, atol=0)
    buffer = io.BytesIO()
    torch.save(layer.state_dict(), buffer)
    buffer.seek(0)
    loaded = build(name, seed=12)
    loaded.load_state_dict(torch.load(buffer, weights_only=True))
    torch.testing.assert_close(loaded(x, mask=real), expected, rtol=0, atol=0)
    duplicate = copy.deepcopy(layer)
    torch.testing.assert_close(duplicate(x, mask=real), expected, rtol=0, atol=0)
    with torch.no_grad():
        for parameter in duplicate.parameters():
            parameter.mul_(1.5)
    torch.testing.assert_close(layer(x, mask=real), expected, rtol=0, atol=0)  # the copy shares nothing


@pytest.mark.parametrize("name", NAMES)
def test_a_float32_layer_moved_to_float64(name):
    layer = build(name, dtype=torch.float32)
    x = tokens(2, 6, dtype=torch.float32)
    real = torch.tensor([[True] * 6, [True] * 3 + [False] * 3])
    single = layer(x, mask=real)
    layer.to(torch.float64)
    double = layer(x.double(), mask=real)
    assert double.dtype == torch.float64
    torch.testing.assert_close(single.double()[real], double[real], rtol=0, atol=1e-5)  # float32 rounding only
    with pytest.raises(TypeError, match="x is torch.float32 but the parameters are torch.float64"):
        layer(x)
    torch.testing.assert_close(double[0], dense_reference(layer, x.double()[0]), rtol=0, atol=1e-12)


# -- copy_projections ----------------------------------------------------------------------------------------------
def test_copy_projections_names_an_unknown_role():
    with pytest.raises(ValueError, match="query"):
        copy_projections(build("softmax"), {"q": (torch.zeros(EMBED_DIM, EMBED_DIM, dtype=DTYPE), None)})


def test_copy_projections_refuses_a_weight_of_the_wrong_shape():
    layer = build("softmax")
    with pytest.raises(ValueError, match="shape"):
        copy_projections(layer, {"query": (torch.zeros(2 * EMBED_DIM, EMBED_DIM, dtype=DTYPE), None)})


def test_copy_projections_refuses_a_bias_of_the_wrong_shape():
    layer = build("softmax")
    weight = torch.zeros(EMBED_DIM, EMBED_DIM, dtype=DTYPE)
    with pytest.raises(ValueError, match="bias"):
        copy_projections(layer, {"query": (weight, torch.tensor([3.0], dtype=DTYPE))})


# -- the integrations' masks ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["softmax", "kep_svgp", "cgpt"])
def test_the_adapters_read_foreign_masks_as_the_boolean_padding_mask(name):
    from gpattn.integrations.huggingface import HuggingFaceAttentionAdapter

    layer = build(name)
    x = tokens(2, 5)
    real = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    expected = layer(x, mask=real)
    additive = torch.zeros(2, 1, 5, 5, dtype=DTYPE).masked_fill(~real[:, None, None, :], torch.finfo(DTYPE).min)
    symmetric = real[:, None, :, None] & real[:, None, None, :]  # NaFlexViT: padding queries see nothing
    for mask in (real[:, None, None, :], additive, symmetric, additive.masked_fill(~real[:, None, None, :], -math.inf)):
        assert torch.equal(padding_mask(mask, 2, 5), real)
    adapter = HuggingFaceAttentionAdapter(layer)
    for mask in (real.long(), real.double(), additive, real[:, None, None, :]):  # keep-masks 1 = real; 4-D masks
        output, weights = adapter(x, attention_mask=mask)
        assert weights is None
        torch.testing.assert_close(output[real], expected[real], rtol=0, atol=0)
    timm_adapter = pytest.importorskip("gpattn.integrations.timm").TimmAttentionAdapter(layer)
    torch.testing.assert_close(timm_adapter(x, attn_mask=symmetric)[real], expected[real], rtol=0, atol=0)
