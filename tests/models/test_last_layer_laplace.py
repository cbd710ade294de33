"""The last-layer Laplace wrapper against laplace-torch's own last-layer Laplace on the whole model, and its GLM
predictive against the dense formula (float64)."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from laplace import Laplace

from gpattn.models import LastLayerLaplace, Transformer

NUM_CLASSES = 3


def _model(seed: int = 0, **kwargs) -> Transformer:
    torch.manual_seed(seed)
    arguments = {"input": "vectors", "input_dim": 4, "max_len": 6, **kwargs}
    return Transformer(NUM_CLASSES, embed_dim=8, depth=1, num_heads=2, attention="softmax", **arguments).double()


@pytest.fixture(scope="module")
def problem():
    """A float64 vector model trained for a few steps on a learnable problem, its training data and test inputs."""
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(120, 6, 4, generator=generator, dtype=torch.float64)
    labels = (inputs[:, :, 0].sum(-1) > 0).long() + (inputs[:, :, 1].sum(-1) > 1.5).long()
    model = _model()
    optimiser = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(60):
        optimiser.zero_grad()
        torch.nn.functional.cross_entropy(model(inputs), labels).backward()
        optimiser.step()
    model.eval()
    test = torch.randn(9, 6, 4, generator=generator, dtype=torch.float64)
    return model, inputs, labels, test


@pytest.fixture(scope="module")
def fitted(problem):
    model, inputs, labels, _ = problem
    return LastLayerLaplace(model).fit(inputs, labels, batch_size=32)


@pytest.fixture(scope="module")
def reference(problem):
    """laplace-torch's last-layer Laplace on the whole model (it calls the model with the inputs alone)."""
    model, inputs, labels, _ = problem
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs, labels), batch_size=32)
    laplace = Laplace(model, "classification", subset_of_weights="last_layer", hessian_structure="kron")
    laplace.fit(loader)
    with pytest.warns(UserWarning, match="link_approx"):
        laplace.optimize_prior_precision(method="marglik")
    return laplace


def test_the_approximation_is_laplace_torch_s_on_the_whole_model(problem, fitted, reference):
    model, _, _, test = problem
    # laplace-torch found the same last layer (in its copy of the model) ...
    assert reference.model._last_layer_name == "head" and torch.equal(
        reference.model.last_layer.weight, model.head.weight
    )
    laplace = fitted.laplace
    assert type(laplace).__name__ == "KronLLLaplace" and laplace.n_params == 8 * NUM_CLASSES + NUM_CLASSES
    # ... the same curvature, prior precision (by the marginal likelihood) and posterior precision
    torch.testing.assert_close(laplace.prior_precision, reference.prior_precision, rtol=1e-10, atol=0)
    assert laplace.prior_precision.numel() == 1 and abs(float(laplace.prior_precision) - 1.0) > 1e-3  # optimised
    torch.testing.assert_close(
        laplace.posterior_precision.to_matrix(), reference.posterior_precision.to_matrix(), rtol=1e-10, atol=1e-10
    )
    # and the same GLM predictive of the logits
    mean, covariance = fitted.predictive_moments(test)
    expected_mean, expected_covariance = reference._glm_predictive_distribution(test)
    torch.testing.assert_close(mean, expected_mean, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(covariance, expected_covariance, rtol=1e-10, atol=1e-12)
    with torch.no_grad():  # the mean: the trained model's logits
        torch.testing.assert_close(mean, model(test), rtol=1e-12, atol=1e-12)


def test_prior_precision_maximises_the_marginal_likelihood(fitted):
    laplace = fitted.laplace
    optimum = laplace.prior_precision.clone()
    with torch.no_grad():
        best = float(laplace.log_marginal_likelihood(prior_precision=optimum))
        for factor in (0.8, 0.95, 1.05, 1.25):
            assert float(laplace.log_marginal_likelihood(prior_precision=optimum * factor)) < best
    laplace.prior_precision = optimum


def test_predictive_covariance_is_the_dense_formula(problem, fitted):
    """:math:`J \\Sigma J^\\top` with :math:`J = [\\phi^\\top \\otimes I_C, I_C]` built by hand and :math:`\\Sigma` the
    inverse of the dense posterior precision."""
    _, _, _, test = problem
    features = fitted.features(test)  # (B, D)
    with torch.no_grad():
        torch.testing.assert_close(fitted.model.head(features), fitted(test), rtol=1e-12, atol=1e-12)
    identity = torch.eye(NUM_CLASSES, dtype=torch.float64)
    # parameters: the weight W (C, D) row by row, then the bias
    jacobian = torch.stack([torch.cat([torch.kron(identity, phi[None, :]), identity], dim=1) for phi in features])
    covariance = torch.linalg.inv(fitted.laplace.posterior_precision.to_matrix())
    _, predictive = fitted.predictive_moments(test)
    torch.testing.assert_close(predictive, jacobian @ covariance @ jacobian.transpose(1, 2), rtol=1e-9, atol=1e-12)
    assert torch.linalg.eigvalsh(predictive).min() > 0


def test_monte_carlo_probabilities_agree_with_laplace_torch_s_mc_predictive(problem, fitted, reference):
    _, _, _, test = problem
    draws = 20000
    torch.manual_seed(3)
    samples = fitted.sample_logits(test, num_samples=draws).softmax(-1)  # (T, B, C)
    assert samples.shape == (draws, len(test), NUM_CLASSES) and samples.dtype == torch.float64
    torch.manual_seed(4)
    expected = reference(test, pred_type="glm", link_approx="mc", n_samples=draws)
    # two independent Monte Carlo means of one expectation: their difference has standard error sqrt(2) sigma / sqrt(T)
    error = math.sqrt(2.0) * samples.std(dim=0) / math.sqrt(draws)
    assert ((samples.mean(0) - expected).abs() < 5 * error + 1e-12).all()
    assert (samples.std(dim=0) > 1e-3).any()  # the predictive does vary: the check above could fail


def test_samples_are_the_gaussian_moments_and_independent_across_inputs(problem, fitted):
    _, _, _, test = problem
    pair = torch.cat([test[:1], test[:1]])  # the same input twice
    torch.manual_seed(0)
    logits = fitted.sample_logits(pair, num_samples=4000)
    mean, covariance = fitted.predictive_moments(test[:1])
    for twin in range(2):
        torch.testing.assert_close(
            logits[:, twin].mean(0), mean[0], rtol=0, atol=5 * covariance[0].diag().max() ** 0.5 / 60
        )
        empirical = torch.cov(logits[:, twin].T)
        torch.testing.assert_close(empirical, covariance[0], rtol=0.1, atol=0.1 * covariance[0].diag().max())
    # laplace-torch's functional_samples would draw one noise vector for the whole batch: here the copies differ
    assert not torch.allclose(logits[:, 0], logits[:, 1])
    correlation = torch.corrcoef(torch.stack([logits[:, 0, 0], logits[:, 1, 0]]))[0, 1]
    assert abs(float(correlation)) < 0.1
    torch.manual_seed(0)
    batched = fitted.sample_logits(pair, num_samples=4000, batch_size=1)  # by batches: the same shape, finite
    assert batched.shape == logits.shape and torch.isfinite(batched).all()


def test_a_padding_mask_reaches_the_model():
    torch.manual_seed(0)
    model = Transformer(2, embed_dim=8, depth=1, num_heads=2, attention="softmax", vocab_size=5, max_len=6).double()
    tokens = torch.randint(1, 5, (40, 6))
    mask = torch.ones(40, 6, dtype=torch.bool)
    mask[::2, 4:] = False
    labels = torch.randint(0, 2, (40,))
    laplace = LastLayerLaplace(model).fit(tokens, labels, mask, batch_size=16)
    changed = torch.where(mask, tokens, torch.zeros_like(tokens))  # other values at the padded positions
    with torch.no_grad():
        expected = model(tokens, mask=mask)
    mean, _ = laplace.predictive_moments(changed, mask, batch_size=7)
    torch.testing.assert_close(mean, expected, rtol=1e-12, atol=1e-12)
    assert laplace.sample_logits(tokens, mask, num_samples=3, batch_size=16).shape == (3, 40, 2)


def test_a_mask_of_another_batch_size_is_refused_not_read_in_part(problem, fitted):
    # a mask of 18 rows for 9 inputs was cut with the inputs: its first 9 rows were read, the rest ignored, no error
    _, _, _, test = problem
    longer = torch.ones(2 * test.shape[0], test.shape[1], dtype=torch.bool)
    with pytest.raises(ValueError, match=r"sample_logits: expected a mask with one row per input \(9 inputs\), got"):
        fitted.sample_logits(test, longer, num_samples=2)
    for method in (fitted.features, fitted.predictive_moments):
        with pytest.raises(ValueError, match=r"LastLayerLaplace: expected a mask with one row per input \(9 inputs\)"):
            method(test, longer)
    mean, _ = fitted.predictive_moments(test, longer[: test.shape[0]])  # one row per input: as without a mask
    torch.testing.assert_close(mean, fitted.predictive_moments(test)[0], rtol=1e-12, atol=1e-12)


def test_sampling_errors_name_the_method(problem, fitted):
    _, _, _, test_inputs = problem
    with pytest.raises(ValueError, match=r"sample_logits: expected at least one input"):
        fitted.sample_logits(test_inputs[:0])  # was "range() arg 3 must not be zero"
    with pytest.raises(ValueError, match=r"LastLayerLaplace: expected batch_size to be a positive integer, got 0"):
        fitted.sample_logits(test_inputs, batch_size=0)


def test_errors():
    model = _model()
    with pytest.raises(ValueError, match=r"expected the submodule 'norm' of the model to be its last layer, a "):
        LastLayerLaplace(model, last_layer="norm")
    with pytest.raises(ValueError, match=r"found nothing"):
        LastLayerLaplace(model, last_layer="classifier")
    with pytest.raises(TypeError, match="expected model to be a torch.nn.Module"):
        LastLayerLaplace("model")
    laplace = LastLayerLaplace(model)
    inputs = torch.randn(5, 6, 4, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"call fit\(\) on the training data before predicting"):
        laplace.sample_logits(inputs)
    with pytest.raises(ValueError, match=r"expected integer labels of shape \(5,\), got torch.float32 \(5,\)"):
        laplace.fit(inputs, torch.zeros(5))
    classes = model.head.out_features
    with pytest.raises(ValueError, match=rf"fit: expected labels in \[0, {classes - 1}\] \(the {classes} classes of"):
        laplace.fit(inputs, torch.full((5,), classes))  # was laplace-torch's raw IndexError
    with pytest.raises(ValueError, match=r"LastLayerLaplace.fit: expected at least one input, got shape \(0, 6, 4\)"):
        laplace.fit(inputs[:0], torch.zeros(0, dtype=torch.long))  # was torch.cat's "non-empty list of Tensors"
    model.train()
    laplace.features(inputs)
    assert model.training  # the training mode is restored


def _dense_predictive(fitted: LastLayerLaplace, inputs: torch.Tensor) -> torch.Tensor:
    """:math:`J \\Sigma J^\\top` by hand, as in the test of the dense formula."""
    identity = torch.eye(NUM_CLASSES, dtype=torch.float64)
    jacobian = torch.stack(
        [torch.cat([torch.kron(identity, phi[None, :]), identity], dim=1) for phi in fitted.features(inputs)]
    )
    covariance = torch.linalg.inv(fitted.laplace.posterior_precision.to_matrix())
    return jacobian @ covariance @ jacobian.transpose(1, 2)


def test_a_deep_copy_predicts_from_its_own_inputs(problem, fitted):
    # laplace-torch's feature hook is a closure over the original's feature extractor: a deep copy's passes stored their
    # features in the original, and the copy read its own stale ones (the last curvature batch, 24 of the 120 inputs):
    # a silently wrong covariance for a batch of that size, a raw reshape error for any other
    _, _, _, test = problem
    duplicate = copy.deepcopy(fitted)
    fresh = torch.randn(24, 6, 4, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    for batch in (fresh, test):
        mean, covariance = duplicate.predictive_moments(batch)
        torch.testing.assert_close(covariance, _dense_predictive(fitted, batch), rtol=1e-9, atol=1e-12)
        with torch.no_grad():
            torch.testing.assert_close(mean, fitted.model(batch), rtol=1e-12, atol=1e-12)
    torch.manual_seed(1)
    expected = fitted.sample_logits(test, num_samples=5)
    torch.manual_seed(1)
    torch.testing.assert_close(duplicate.sample_logits(test, num_samples=5), expected, rtol=1e-12, atol=1e-12)


def test_labels_of_any_integer_dtype_and_a_numpy_batch_size_fit_the_same_posterior_without_touching_the_rng(
    problem, fitted
):
    # int32 labels were laplace-torch's raw "expected target dtype to be Long or Byte"; a NumPy batch size the
    # DataLoader's raw error; and the loader's iterator drew its seed from the global RNG
    model, inputs, labels, _ = problem
    state = torch.get_rng_state()
    again = LastLayerLaplace(model).fit(inputs, labels.to(torch.int32), batch_size=np.int64(32))
    assert torch.equal(torch.get_rng_state(), state)
    torch.testing.assert_close(again.laplace.prior_precision, fitted.laplace.prior_precision, rtol=1e-12, atol=0)
    torch.testing.assert_close(
        again.laplace.posterior_precision.to_matrix(),
        fitted.laplace.posterior_precision.to_matrix(),
        rtol=1e-12,
        atol=1e-12,
    )
    for wrong in (labels.bool(), labels.to(torch.complex64)):
        with pytest.raises(TypeError, match=r"fit: expected integer labels of shape \(120,\)"):
            LastLayerLaplace(model).fit(inputs, wrong)


def test_the_laplace_torch_object_is_rebuilt_from_the_fit_and_leaves_it_alone(problem, fitted):
    _, _, _, test = problem
    laplace = fitted.laplace
    # at the MAP weights, with the fit's posterior: its functional variance is the module's predictive covariance
    head = laplace.model.last_layer
    assert torch.equal(head.weight, fitted.model.head.weight) and torch.equal(head.bias, fitted.model.head.bias)
    state = fitted.get_extra_state()
    assert torch.equal(laplace.mean, state["mean"]) and torch.equal(laplace.prior_precision, state["prior_precision"])
    features = fitted.features(test)
    identity = torch.eye(NUM_CLASSES, dtype=torch.float64)
    jacobians = torch.cat(
        [torch.einsum("bd,ij->bijd", features, identity).flatten(2), identity.expand(len(test), -1, -1)], dim=-1
    )
    mean, covariance = fitted.predictive_moments(test)
    torch.testing.assert_close(laplace.functional_variance(jacobians), covariance, rtol=1e-12, atol=1e-14)
    laplace.prior_precision = 100.0  # a change of the rebuilt object is its own
    assert torch.equal(fitted.laplace.prior_precision, state["prior_precision"])
    again = fitted.predictive_moments(test)
    assert torch.equal(again[0], mean) and torch.equal(again[1], covariance)


def test_a_last_layer_without_bias_has_the_dense_predictive(problem):
    model, inputs, labels, test = problem
    model = copy.deepcopy(model)
    model.head = torch.nn.Linear(8, NUM_CLASSES, bias=False, dtype=torch.float64)
    laplace = LastLayerLaplace(model).fit(inputs, labels, batch_size=32)
    assert laplace.get_extra_state()["mean"].shape == (8 * NUM_CLASSES,)
    features = laplace.features(test)
    jacobian = torch.stack([torch.kron(torch.eye(NUM_CLASSES, dtype=torch.float64), phi[None, :]) for phi in features])
    covariance = torch.linalg.inv(laplace.laplace.posterior_precision.to_matrix())
    mean, predictive = laplace.predictive_moments(test)
    torch.testing.assert_close(predictive, jacobian @ covariance @ jacobian.transpose(1, 2), rtol=1e-9, atol=1e-12)
    with torch.no_grad():
        torch.testing.assert_close(mean, model(test), rtol=1e-12, atol=1e-12)


def test_an_extra_state_that_is_not_a_fit_of_this_last_layer_is_refused(fitted):
    state = fitted.get_extra_state()
    unfitted = LastLayerLaplace(_model())
    with pytest.raises(ValueError, match=r"expected an extra state with a boolean 'fitted' entry, got list"):
        unfitted.set_extra_state([state])
    with pytest.raises(
        ValueError, match=r"the extra state of a fit lacks the entries \['eigenvalues', 'eigenvectors'\]"
    ):
        unfitted.set_extra_state({key: value for key, value in state.items() if not key.startswith("eigen")})
    with pytest.raises(
        ValueError, match=r"expected the fitted mean of the last layer 'head' to have shape \(27,\), got"
    ):
        unfitted.set_extra_state({**state, "mean": state["mean"][:-1]})
    assert unfitted.laplace is None  # each refusal left it unfitted
