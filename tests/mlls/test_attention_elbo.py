""":class:`~gpattn.mlls.AttentionELBO` against a hand computation, and Monte Carlo averaging of
:func:`~gpattn.models.predict_probabilities` (float64)."""

from __future__ import annotations

import functools
import math
from unittest.mock import patch

import pytest
import torch
import torch.nn.functional as F
from gpytorch.kernels import RBFKernel
from gpytorch.module import Module
from gpytorch.priors import GammaPrior, NormalPrior

from gpattn.attention import AttentionLayer, build_attention, sample_attention
from gpattn.mlls import AttentionELBO, KSVDAddedLossTerm, SequenceKLAddedLossTerm
from gpattn.models import Transformer, predict_probabilities

BATCH, CLASSES = 5, 3


class _Penalised(Module):
    """Holds KSVD terms; nested below a plain ``torch.nn`` container to check the search reaches it."""

    def __init__(self):
        super().__init__()
        self.register_added_loss_term("ksvd")
        self.register_added_loss_term("never_computed")  # registered, never updated: contributes nothing


class _ToyModel(Module):
    """Logits are a parameter; KL = 3 w^2; two KSVD terms of weight ``eta``, one registered twice."""

    def __init__(self, first: torch.Tensor, second: torch.Tensor, eta: float):
        super().__init__()
        self.logits = torch.nn.Parameter(torch.randn(BATCH, CLASSES, dtype=torch.float64))
        self.weight = torch.nn.Parameter(torch.tensor(0.7, dtype=torch.float64))
        self.container = torch.nn.Sequential(_Penalised())
        self.register_added_loss_term("ksvd")
        self.update_added_loss_term("ksvd", KSVDAddedLossTerm(first, eta))
        second_term = KSVDAddedLossTerm(second, eta, num_averaged_dims=1)
        self.container[0].update_added_loss_term("ksvd", second_term)
        self.register_added_loss_term("same_term_again")
        self.update_added_loss_term("same_term_again", second_term)

    def forward(self) -> torch.Tensor:
        return self.logits

    def kl_divergence(self) -> torch.Tensor:
        return 3 * self.weight**2


def _toy(eta: float = 1.0) -> tuple[_ToyModel, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    first = torch.tensor([0.3, -0.2], dtype=torch.float64)
    second = torch.tensor([[0.5, 1.0, -1.0], [0.1, 0.2, 0.3]], dtype=torch.float64)
    targets = torch.tensor([0, 2, 1, 1, 0])
    return _ToyModel(first, second, eta), first, second, targets


def test_loss_equals_hand_computation():
    beta, eta, num_data = 0.5, 3.0, 40
    model, first, second, targets = _toy(eta)
    loss = AttentionELBO(model, num_data, beta=beta)(model(), targets)
    # sum_i J1_i^2 + mean over the first dim of sum_j J2_ij^2 (num_averaged_dims=1), counted once
    ksvd = first.pow(2).sum() + second.pow(2).sum(dim=1).mean()
    expected = F.cross_entropy(model.logits, targets) + beta / num_data * 3 * 0.7**2 + eta * ksvd
    torch.testing.assert_close(loss, expected, rtol=1e-14, atol=0)
    loss.backward()
    torch.testing.assert_close(model.weight.grad, torch.tensor(beta / num_data * 6 * 0.7, dtype=torch.float64))


def test_parts_sum_to_the_loss():
    model, first, second, targets = _toy(eta=0.5)
    parts = AttentionELBO(model, 10, beta=2.0, combine_terms=False)(model(), targets)
    assert set(parts) == {"nll", "kl", "ksvd", "prior", "loss"}
    assert parts["prior"] == 0  # no hyperparameter prior registered
    torch.testing.assert_close(parts["nll"], F.cross_entropy(model.logits, targets))
    torch.testing.assert_close(parts["kl"], 2.0 / 10 * model.kl_divergence())
    torch.testing.assert_close(parts["ksvd"], 0.5 * (first.pow(2).sum() + second.pow(2).sum(dim=1).mean()))
    torch.testing.assert_close(parts["loss"], parts["nll"] + parts["kl"] + parts["ksvd"], rtol=1e-14, atol=0)
    combined = AttentionELBO(model, 10, beta=2.0)(model(), targets)
    torch.testing.assert_close(combined, parts["loss"], rtol=0, atol=0)


def test_registered_hyperparameter_priors_enter_the_loss_divided_by_num_data():
    # GPyTorch's approximate MLLs add (1/n) sum log p(theta) of the registered priors; the loss subtracts it (it was
    # left out: a prior a GPyTorch user registered changed nothing, without a word)
    beta, eta, num_data = 0.5, 3.0, 40
    model, _, _, targets = _toy(eta)
    without = AttentionELBO(model, num_data, beta=beta, combine_terms=False)(model(), targets)
    model.register_prior("weight_prior", GammaPrior(2.0, 3.0), "weight")
    model.container[0].register_parameter("scale", torch.nn.Parameter(torch.tensor([0.4, 1.5], dtype=torch.float64)))
    model.container[0].register_prior("scale_prior", NormalPrior(1.0, 0.5), "scale")
    model.double()  # the priors' parameters too
    parts = AttentionELBO(model, num_data, beta=beta, combine_terms=False)(model(), targets)
    f64 = functools.partial(torch.tensor, dtype=torch.float64)
    log_prior = torch.distributions.Gamma(f64(2.0), f64(3.0)).log_prob(f64(0.7))
    log_prior = log_prior + torch.distributions.Normal(f64(1.0), f64(0.5)).log_prob(model.container[0].scale).sum()
    torch.testing.assert_close(parts["prior"], -log_prior / num_data, rtol=1e-14, atol=0)
    torch.testing.assert_close(parts["loss"], without["loss"] - log_prior / num_data, rtol=1e-14, atol=0)
    for name in ("nll", "kl", "ksvd"):
        torch.testing.assert_close(parts[name], without[name], rtol=0, atol=0)
    combined = AttentionELBO(model, num_data, beta=beta)(model(), targets)
    torch.testing.assert_close(combined, parts["loss"], rtol=0, atol=0)
    combined.backward()  # the prior's gradient: d/dw [beta/n 3 w^2 - log Gamma(w; 2, 3) / n] = (beta 6 w - 1/w + 3)/n
    expected = (beta * 6 * 0.7 - 1 / 0.7 + 3.0) / num_data
    torch.testing.assert_close(model.weight.grad, torch.tensor(expected, dtype=torch.float64), rtol=1e-13, atol=0)


def test_a_lengthscale_prior_of_the_svgp_attention_counts_as_in_gpytorch():
    # the symmetric SVGP attention's RBF kernel, with a prior as a GPyTorch user sets it; the reference is GPyTorch's
    # own sum over named_priors() (as its VariationalELBO forms it) and torch.distributions
    torch.manual_seed(0)
    model = Transformer(CLASSES, embed_dim=8, num_heads=2, attention="svgp", num_inducing=3, vocab_size=5, max_len=6)
    kernels = [module for module in model.modules() if isinstance(module, RBFKernel)]
    assert kernels
    for kernel in kernels:
        kernel.register_prior("lengthscale_prior", GammaPrior(3.0, 6.0), lambda m: m.lengthscale)
    model = model.double().train()
    ids, targets = torch.randint(0, 5, (BATCH, 6)), torch.tensor([0, 1, 2, 0, 1])
    parts = AttentionELBO(model, 100, combine_terms=False)(model(ids), targets)
    gpytorch_sum = sum(prior.log_prob(closure(module)).sum() for _, module, prior, closure, _ in model.named_priors())
    distributions_sum = sum(
        torch.distributions.Gamma(*torch.tensor([3.0, 6.0], dtype=torch.float64)).log_prob(kernel.lengthscale).sum()
        for kernel in kernels
    )
    torch.testing.assert_close(gpytorch_sum, distributions_sum, rtol=1e-14, atol=0)
    torch.testing.assert_close(parts["prior"], -distributions_sum / 100, rtol=1e-14, atol=0)
    torch.testing.assert_close(parts["loss"], parts["nll"] + parts["kl"] + parts["ksvd"] + parts["prior"])


def test_monte_carlo_logits_average_over_samples_and_batch():
    model, _, _, targets = _toy()
    samples = torch.randn(4, BATCH, CLASSES, dtype=torch.float64)
    parts = AttentionELBO(model, 10, combine_terms=False)(samples, targets)
    expected = torch.stack([F.cross_entropy(sample, targets) for sample in samples]).mean()
    torch.testing.assert_close(parts["nll"], expected, rtol=1e-14, atol=0)


def test_transformer_terms():
    torch.manual_seed(0)
    model = Transformer(
        CLASSES,
        embed_dim=16,
        num_heads=2,
        attention="kep_svgp",
        num_inducing=4,
        ksvd_weight=10.0,
        vocab_size=7,
        max_len=8,
    )
    model = model.double().train()
    ids, targets = torch.randint(0, 7, (BATCH, 6)), torch.tensor([0, 1, 2, 0, 1])
    logits = model(ids)
    parts = AttentionELBO(model, 100, beta=1.0, combine_terms=False)(logits, targets)
    terms = list(model.added_loss_terms())
    assert terms, "the KEP-SVGP layer registers its KSVD term"
    assert all(term.weight == 10.0 for term in terms), "the layer's ksvd_weight is the term's eta"
    squared = sum(term.objective.pow(2).mean(0).sum() for term in terms)  # J^2, mean over sequences, sum over heads
    torch.testing.assert_close(parts["ksvd"], 10.0 * squared)
    torch.testing.assert_close(parts["kl"], model.kl_divergence() / 100)
    assert parts["kl"] > 0 and parts["ksvd"] > 0
    parts["loss"].backward()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("attention", ["kep_svgp", "primal"])
def test_an_eval_pass_has_no_ksvd_penalty_not_the_last_training_passs(attention):
    """The ELBO after an eval-mode pass (no J computed) read the penalty of the last training pass, still attached to
    its graph (a second backward raised torch's "backward through the graph a second time")."""
    torch.manual_seed(0)
    model = Transformer(CLASSES, embed_dim=16, num_heads=2, attention=attention, vocab_size=7, max_len=8).double()
    ids, targets = torch.randint(0, 7, (BATCH, 6)), torch.tensor([0, 1, 2, 0, 1])
    elbo = AttentionELBO(model, 100, combine_terms=False)
    model.train()
    trained = elbo(model(ids), targets)
    assert trained["ksvd"] > 0
    trained["loss"].backward()
    model.eval()
    logits = model(ids.flip(0))
    evaluated = elbo(logits, targets)
    assert evaluated["ksvd"] == 0.0
    torch.testing.assert_close(
        evaluated["loss"], F.cross_entropy(logits, targets) + evaluated["kl"], rtol=1e-14, atol=0
    )
    evaluated["loss"].backward()  # its own graph only
    model.train()
    assert elbo(model(ids), targets)["ksvd"] > 0  # the next training pass registers its penalty again


def test_targets_of_any_integer_dtype_give_the_int64_loss():
    model, _, _, targets = _toy()
    elbo = AttentionELBO(model, 10)
    expected = elbo(model(), targets)
    for dtype in (torch.int32, torch.int16, torch.int8, torch.uint8):
        torch.testing.assert_close(elbo(model(), targets.to(dtype)), expected, rtol=0, atol=0)


def test_invalid_arguments():
    model, _, _, targets = _toy()
    with pytest.raises(ValueError, match="num_data"):
        AttentionELBO(model, 0)
    with pytest.raises(ValueError, match="beta"):
        AttentionELBO(model, 10, beta=-1.0)
    with pytest.raises(ValueError, match="kl_divergence"):
        AttentionELBO(torch.nn.Linear(2, 2), 10)
    elbo = AttentionELBO(model, 10)
    with pytest.raises(ValueError, match="targets"):
        elbo(model(), targets[:-1])
    with pytest.raises(ValueError, match="logits"):
        elbo(model()[0], targets)


@pytest.mark.parametrize("shape", [(0, CLASSES), (BATCH, 0), (0, BATCH, CLASSES), (2, 0, CLASSES)])
def test_an_empty_batch_is_a_clear_error_not_nan(shape):
    # F.cross_entropy's mean over no sequence is NaN: a silent NaN loss before the check
    model, _, _, _ = _toy()
    elbo = AttentionELBO(model, 10)
    targets = torch.zeros(shape[-2], dtype=torch.long)
    with pytest.raises(ValueError, match=r"empty batch"):
        elbo(torch.zeros(shape), targets)


class _NoisyLayer(AttentionLayer):
    """Identity plus unit Gaussian noise when sampling."""

    is_stochastic = True

    def forward(self, x, mask=None, context=None):
        inputs = self._prepare(x, mask, context)
        return inputs.queries + torch.randn_like(inputs.queries) if self.sampling else inputs.queries


class _NoisyClassifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = _NoisyLayer(CLASSES, 1)
        self.calls = 0

    def forward(self, inputs, mask=None):
        self.calls += 1
        return self.attention(inputs, mask=mask).mean(dim=1)  # shape: (B, C)


@pytest.mark.parametrize("average", ["probabilities", "logits"])
def test_predict_probabilities_averages_samples(average):
    model = _NoisyClassifier().train()
    inputs = torch.randn(BATCH, 4, CLASSES, dtype=torch.float64)
    torch.manual_seed(1)
    probabilities = predict_probabilities(model, inputs, num_samples=6, average=average)
    assert model.calls == 6 and model.training and not model.attention.sample_in_eval
    torch.manual_seed(1)
    model.eval()
    with sample_attention(model):
        logits = torch.stack([model(inputs) for _ in range(6)])
    assert logits.std(dim=0).min() > 0  # the samples differ
    if average == "probabilities":
        expected = logits.softmax(dim=-1).mean(dim=0)
    else:
        expected = logits.mean(dim=0).softmax(dim=-1)
    torch.testing.assert_close(probabilities, expected, rtol=1e-14, atol=0)
    torch.testing.assert_close(probabilities.sum(dim=-1), torch.ones(BATCH, dtype=torch.float64))
    assert not probabilities.requires_grad


def test_predict_probabilities_of_a_deterministic_model_runs_once():
    torch.manual_seed(0)
    model = Transformer(CLASSES, embed_dim=8, num_heads=2, attention="softmax", vocab_size=5, max_len=6, dropout=0.5)
    ids, mask = torch.randint(0, 5, (BATCH, 6)), torch.arange(6) < torch.tensor([6, 2, 3, 4, 1])[:, None]
    with patch.object(model, "forward", wraps=model.forward) as forward:
        probabilities = predict_probabilities(model, ids, mask=mask, num_samples=10)
    assert forward.call_count == 1 and model.training
    model.eval()
    torch.testing.assert_close(probabilities, model(ids, mask=mask).softmax(dim=-1), rtol=0, atol=0)


def test_predict_probabilities_of_a_gp_transformer():
    torch.manual_seed(0)
    model = Transformer(
        CLASSES, embed_dim=16, num_heads=2, attention="kep_svgp", num_inducing=4, vocab_size=5, max_len=6
    )
    ids = torch.randint(0, 5, (BATCH, 6))
    torch.manual_seed(2)
    probabilities = predict_probabilities(model, ids, num_samples=4)
    model.eval()
    torch.manual_seed(2)
    with sample_attention(model), torch.no_grad():
        expected = torch.stack([model(ids).softmax(dim=-1) for _ in range(4)]).mean(dim=0)
    torch.testing.assert_close(probabilities, expected, rtol=0, atol=0)
    assert not torch.allclose(probabilities, model(ids).softmax(dim=-1))  # not the predictive-mean pass
    with pytest.raises(ValueError, match="num_samples"):
        predict_probabilities(model, ids, num_samples=0)
    with pytest.raises(ValueError, match="average"):
        predict_probabilities(model, ids, average="median")


# -- models without kl_divergence(), outputs that hold the logits (foreign models, gpattn.integrations) -------------
class _Foreign(torch.nn.Module):
    """No kl_divergence() of its own: two GP layers (one shared by two containers) and a softmax layer, nested in
    plain containers; returns a dict, as a transformers model returns a ModelOutput."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        gp = build_attention("svgp", 4, 2, num_inducing=3).double()
        self.blocks = torch.nn.ModuleList(
            [
                torch.nn.Sequential(gp),
                torch.nn.Sequential(build_attention("kep_svgp", 4, 2, num_inducing=2).double()),
                torch.nn.Sequential(gp, build_attention("softmax", 4, 2).double()),
            ]
        )
        self.head = torch.nn.Linear(4, CLASSES).double()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> dict:
        for block in self.blocks:
            for layer in block:
                input_ids = layer(input_ids, mask=attention_mask)
        return {"logits": self.head(input_ids.mean(dim=1)), "hidden": input_ids}


def test_elbo_sums_the_kl_of_the_gp_layers_of_a_model_without_kl_divergence():
    model = _Foreign().train()
    tokens, targets = torch.randn(BATCH, 6, 4, dtype=torch.float64), torch.tensor([0, 2, 1, 1, 0])
    output = model(tokens)
    parts = AttentionELBO(model, num_data=20, beta=0.5, combine_terms=False)(output, targets)
    gp, kep, softmax = model.blocks[0][0], model.blocks[1][0], model.blocks[2][1]
    # each layer once (the shared one too), computed by the layer itself; the GPyTorch strategy inside the SVGP
    # layer (which has a kl_divergence() of its own) is the layer's, not counted again
    expected = (gp.kl_divergence() + kep.kl_divergence() + softmax.kl_divergence()) * 0.5 / 20
    assert gp.kl_divergence() > 0 and kep.kl_divergence() > 0
    torch.testing.assert_close(parts["kl"], expected, rtol=1e-14, atol=0)
    torch.testing.assert_close(parts["nll"], F.cross_entropy(output["logits"], targets), rtol=0, atol=0)
    parts["loss"].backward()
    assert kep.strategy._variational_distribution.variational_mean.grad.abs().sum() > 0


def test_elbo_reads_the_logits_of_a_mapping_output():
    model = _Foreign()
    tokens, targets = torch.randn(BATCH, 6, 4, dtype=torch.float64), torch.tensor([0, 2, 1, 1, 0])
    elbo = AttentionELBO(model, num_data=20)
    output = model.eval()(tokens)
    torch.testing.assert_close(elbo(output, targets), elbo(output["logits"], targets), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"no 'logits' entry \(it has \['hidden'\]\)"):
        elbo({"hidden": output["hidden"]}, targets)


def test_predict_probabilities_takes_a_mapping_of_keyword_inputs():
    model = _Foreign().eval()
    tokens = torch.randn(BATCH, 6, 4, dtype=torch.float64)
    mask = torch.arange(6) < torch.tensor([6, 2, 3, 4, 1])[:, None]
    inputs = {"input_ids": tokens, "attention_mask": mask}
    torch.manual_seed(4)
    probabilities = predict_probabilities(model, inputs, num_samples=3)
    torch.manual_seed(4)
    with sample_attention(model), torch.no_grad():
        expected = torch.stack([model(tokens, attention_mask=mask)["logits"].softmax(-1) for _ in range(3)]).mean(0)
    torch.testing.assert_close(probabilities, expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="pass the mask inside it"):
        predict_probabilities(model, inputs, mask=mask)


def test_predict_probabilities_calls_a_model_without_a_mask_argument_and_checks_its_output():
    class _NoMask(torch.nn.Module):
        def __init__(self, output):
            super().__init__()
            self.output = output

        def forward(self, inputs):
            return self.output(inputs)

    inputs = torch.randn(BATCH, CLASSES, dtype=torch.float64)
    probabilities = predict_probabilities(_NoMask(lambda x: x), inputs)
    torch.testing.assert_close(probabilities, inputs.softmax(-1), rtol=0, atol=0)
    with pytest.raises(TypeError, match="logits as a Tensor or a mapping.*got tuple"):
        predict_probabilities(_NoMask(lambda x: (x,)), inputs)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_logits_are_a_clear_error(bad: float):
    model, _, _, targets = _toy()
    logits = model().detach().clone()
    logits[1, 2] = bad
    with pytest.raises(ValueError, match=r"logits contain NaN or Inf values \(1 of 15 entries\)"):
        AttentionELBO(model, 10)(logits, targets)
    with pytest.raises(ValueError, match="NaN or Inf"):
        AttentionELBO(model, 10, combine_terms=False)(logits.expand(2, -1, -1), targets)
    # a loop that checks the loss itself gets the non-finite parts
    parts = AttentionELBO(model, 10, combine_terms=False, check_finite=False)(logits, targets)
    assert not torch.isfinite(parts["loss"])


class _SequenceKLModel(Module):
    """A global KL of 2 and a per-sequence KL term (SequenceKLAddedLossTerm) next to a KSVD term."""

    def __init__(self, per_sequence: torch.Tensor):
        super().__init__()
        self.logits = torch.nn.Parameter(torch.randn(BATCH, CLASSES, dtype=torch.float64))
        self.register_added_loss_term("sequence_kl")
        self.update_added_loss_term("sequence_kl", SequenceKLAddedLossTerm(per_sequence))
        self.register_added_loss_term("ksvd")
        self.update_added_loss_term("ksvd", KSVDAddedLossTerm(torch.tensor([0.5], dtype=torch.float64), 2.0))

    def forward(self) -> torch.Tensor:
        return self.logits

    def kl_divergence(self) -> torch.Tensor:
        return torch.tensor(2.0, dtype=torch.float64)


def test_per_sequence_kl_is_weighted_per_sequence_not_divided_by_num_data():
    torch.manual_seed(0)
    per_sequence = torch.tensor([1.0, 3.0, 0.5, 2.0, 4.0], dtype=torch.float64)
    model = _SequenceKLModel(per_sequence)
    targets = torch.tensor([0, 2, 1, 1, 0])
    beta, num_data = 0.7, 1000
    parts = AttentionELBO(model, num_data, beta=beta, combine_terms=False)(model(), targets)
    torch.testing.assert_close(parts["kl"], beta * 2.0 / num_data + beta * per_sequence.mean())
    torch.testing.assert_close(parts["ksvd"], torch.tensor(2.0 * 0.25, dtype=torch.float64))
    nll = F.cross_entropy(model(), targets)
    torch.testing.assert_close(parts["loss"], nll + parts["kl"] + parts["ksvd"])
    with pytest.raises(ValueError, match="sequences"):
        SequenceKLAddedLossTerm(torch.ones(2, 3))
    with pytest.raises(ValueError, match="weight"):
        SequenceKLAddedLossTerm(per_sequence, weight=-1.0)


def test_a_single_class_is_a_clear_error_not_a_zero_loss():
    # log_softmax of one logit is 0: the NLL was 0 whatever the model (a binary classifier with one logit trained
    # nothing but the KL)
    model, _, _, _ = _toy()
    elbo = AttentionELBO(model, 10)
    for shape in [(BATCH, 1), (2, BATCH, 1)]:
        with pytest.raises(ValueError, match=r"at least 2 classes"):
            elbo(torch.randn(shape, dtype=torch.float64), torch.zeros(BATCH, dtype=torch.long))


def test_beta_set_later_is_checked_as_the_argument_and_a_tensor_is_kept():
    model, _, _, targets = _toy()
    elbo = AttentionELBO(model, 40, combine_terms=False)
    for bad, error in [(-0.5, ValueError), (math.nan, ValueError), (True, TypeError), ("1", TypeError)]:
        with pytest.raises(error, match="beta"):
            elbo.beta = bad  # a negative weight was taken: the loss then rewarded a growing KL
    assert elbo.beta == 1.0
    weight = torch.tensor(0.25, dtype=torch.float64)
    elbo.beta = weight  # the training loop's tensor, filled in place: kept, its value not read
    assert elbo.beta is weight
    kl = float(3 * model.weight.detach() ** 2)
    assert float(elbo(model(), targets)["kl"].detach()) == pytest.approx(0.25 * kl / 40, rel=1e-14)
    weight.fill_(0.5)
    assert float(elbo(model(), targets)["kl"].detach()) == pytest.approx(0.5 * kl / 40, rel=1e-14)
