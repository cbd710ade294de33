"""The toy regression experiment: KEP-SVGP against the exact GP with the same induced kernel."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from gpattn.comparison import (
    ToyRegressionConfig,
    ToyRegressionResult,
    format_result,
    run_toy_regression,
    toy_regression,
)
from gpattn.comparison.toy_regression import _guarded_step, fit_exact_gp, fit_pair_svgp, fit_pair_svgp_pyro
from gpattn.data import make_asymmetric_regression_1d
from gpattn.models import KernelEigenPairSVGP
from gpattn.training import TrainingDivergedError

SMOKE = ToyRegressionConfig(iterations=5, pyro_iterations=5, num_landmarks=10, num_inducing=6)


def test_smoke_run_writes_results_and_keeps_the_models(tmp_path) -> None:
    result = run_toy_regression(SMOKE, out=tmp_path, progress=False)
    assert set(result.rmse) == {"exact_gp", "kep_svgp_elbo", "kep_svgp_pyro"}
    assert all(value > 0 for value in result.rmse.values())
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["rmse"] == result.rmse
    assert saved["config"]["num_inducing"] == 6
    assert set(saved) == {"config", "rmse", "rmse_noiseless", "seconds", "learned"}  # the models stay out of the JSON
    # the fitted models (for the posterior figure, which `gpattn regression` draws) reproduce the reported RMSEs
    assert set(result.models) == set(result.rmse) and isinstance(result.models["kep_svgp_elbo"], KernelEigenPairSVGP)
    with torch.no_grad():
        mean = result.models["kep_svgp_elbo"](result.data.test_x).mean
    assert torch.sqrt(((mean - result.data.test_y) ** 2).mean()).item() == pytest.approx(result.rmse["kep_svgp_elbo"])
    table = format_result(result)
    assert "kep_svgp_pyro" in table and "+0.0%" in table  # the exact GP row is the reference


def test_same_seed_same_numbers() -> None:
    first = run_toy_regression(SMOKE, progress=False)
    second = run_toy_regression(SMOKE, progress=False)
    assert first.rmse == second.rmse


@pytest.mark.slow
def test_kep_svgp_matches_exact_gp_on_the_1d_toy() -> None:
    """Issue acceptance: VariationalELBO within 10% and Pyro SVI within 20% of the exact GP's test RMSE."""
    result = run_toy_regression(ToyRegressionConfig(seed=0), progress=False)
    exact = result.rmse["exact_gp"]
    assert exact < 0.15  # noise std is 0.1: the reference itself fits
    assert result.rmse["kep_svgp_elbo"] <= 1.10 * exact
    assert result.rmse["kep_svgp_pyro"] <= 1.20 * exact


def test_config_is_a_plain_dataclass() -> None:
    assert replace(SMOKE, seed=3).seed == 3


# -- divergence ------------------------------------------------------------------------------------------------------
def test_a_diverging_fit_says_so(tmp_path) -> None:
    # a learning rate of 1000 sends the kernel hyperparameters to NaN at the second step of the ELBO fit; the old
    # loop failed later inside the kernel SVD with "kernel matrix contains NaN or Inf", naming no fit
    config = ToyRegressionConfig(iterations=5, pyro_iterations=2, lr=1000.0)
    match = r"^KEP-SVGP \(ELBO\): the fit diverged at iteration 2/5 \(learning rate 1000\): non-finite parameters"
    with pytest.raises(TrainingDivergedError, match=match) as caught:
        run_toy_regression(config, out=tmp_path, progress=False)
    assert "lower the learning rate (ToyRegressionConfig.lr, --lr)" in str(caught.value)
    assert caught.value.epoch == 2 and not (tmp_path / "results.json").exists()


def test_a_step_failing_after_the_first_iteration_is_divergence() -> None:
    module = torch.nn.Linear(1, 1)
    error = RuntimeError("Matrix not positive definite")

    def failing():
        raise error

    with pytest.raises(
        TrainingDivergedError,
        match=r"^fit: the fit diverged at iteration 4/9 \(learning rate 0\.5\): "
        r"the step failed \(RuntimeError: Matrix not positive definite\)",
    ) as caught:
        _guarded_step("fit", 3, 9, 0.5, failing, [module])
    assert caught.value.__cause__ is error
    with pytest.raises(RuntimeError, match="^Matrix not positive definite$"):  # the first step: not divergence
        _guarded_step("fit", 0, 9, 0.5, failing, [module])
    with pytest.raises(TrainingDivergedError, match=r"at iteration 1/9 .*: loss nan"):
        _guarded_step("fit", 0, 9, 0.5, lambda: float("nan"), [module])
    assert _guarded_step("fit", 0, 9, 0.5, lambda: torch.tensor(2.5), [module]) == 2.5


# -- arguments -------------------------------------------------------------------------------------------------------
def test_numpy_settings_are_stored_as_python_numbers_and_the_json_round_trips() -> None:
    # NumPy scalars (e.g. from a sweep) were stored as given: to_json failed with "Object of type int64 is not JSON
    # serializable", after all three fits
    config = ToyRegressionConfig(seed=np.int64(3), num_landmarks=np.int32(10), num_inducing=np.int64(6),
                                 lr=np.float32(0.25), initial_shift=np.float64(-0.5))  # fmt: skip
    assert type(config.seed) is int and type(config.num_landmarks) is int and type(config.num_inducing) is int
    assert type(config.lr) is float and config.lr == 0.25 and type(config.initial_shift) is float
    result = ToyRegressionResult(config, rmse={"exact_gp": 0.5}, rmse_noiseless={"exact_gp": 0.25})
    saved = json.loads(result.to_json())
    assert ToyRegressionConfig(**saved["config"]) == config and saved["rmse"] == {"exact_gp": 0.5}


def test_bad_data_is_refused_before_the_first_step() -> None:
    # a NaN target read as a diverged fit: "the fit diverged at iteration 1/5 ...: loss nan; lower the learning rate"
    data = make_asymmetric_regression_1d(seed=0)
    targets = data.train_y.clone()
    targets[3] = float("nan")
    nan = dataclasses.replace(data, train_y=targets)
    for fit in (fit_exact_gp, fit_pair_svgp, fit_pair_svgp_pyro):
        with pytest.raises(ValueError, match=rf"^{fit.__name__}: data.train_y contains NaN or Inf values$"):
            fit(nan, SMOKE, progress=False)
    empty = dataclasses.replace(data, train_x=data.train_x[:0], train_y=data.train_y[:0])
    with pytest.raises(ValueError, match=r"^fit_exact_gp: expected data.train_x of shape \(N, 1\), non-empty, got"):
        fit_exact_gp(empty, SMOKE, progress=False)
    with pytest.raises(ValueError, match=r"^fit_pair_svgp: expected data.train_y of shape \(200\), got \(199,\)"):
        fit_pair_svgp(dataclasses.replace(data, train_y=data.train_y[1:]), SMOKE, progress=False)
    with pytest.raises(TypeError, match=r"^run_toy_regression: expected config to be a ToyRegressionConfig, got dict"):
        run_toy_regression({"iterations": 5}, progress=False)


def test_one_training_point_gives_the_dense_exact_posterior() -> None:
    # the exact GP against the posterior mean k(x*, x) (k(x, x) + noise)^-1 y of k = k_e + k_r, formed in NumPy from
    # the shifted RBF kernel's definition with the fitted hyperparameters
    data = make_asymmetric_regression_1d(seed=0)
    one = dataclasses.replace(data, train_x=data.train_x[:1], train_y=data.train_y[:1])
    model, likelihood = fit_exact_gp(one, SMOKE, progress=False)
    kernel = model.covar_module.kernel
    shift, scale, outputscale = kernel.shift.item(), kernel.lengthscale.item(), kernel.outputscale.item()
    landmarks = np.linspace(data.grid_x.min().item(), data.grid_x.max().item(), SMOKE.num_landmarks)

    def kappa(x: np.ndarray, z: np.ndarray) -> np.ndarray:
        return outputscale * np.exp(-0.5 * ((x[:, None] - z[None, :] - shift) / scale) ** 2)

    def induced(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        return kappa(x, landmarks) @ kappa(y, landmarks).T + kappa(landmarks, x).T @ kappa(landmarks, y)

    x, y, test = one.train_x[:, 0].numpy(), one.train_y.numpy(), data.test_x[:20, 0].numpy()
    expected = induced(test, x) @ np.linalg.solve(induced(x, x) + likelihood.noise.item() * np.eye(1), y)
    with torch.no_grad():
        mean = model(data.test_x[:20]).mean.numpy()
    np.testing.assert_allclose(mean, expected, rtol=1e-9, atol=1e-12)
    assert np.abs(expected).max() > 1e-3  # a posterior that moved off the zero prior mean


def test_an_output_folder_that_cannot_be_made_fails_before_the_fits(tmp_path, monkeypatch) -> None:
    # the folder was made after the fits: a path naming a file failed with FileExistsError after minutes of fitting
    def no_fit(*args, **kwargs):
        raise AssertionError("a fit ran")

    monkeypatch.setattr(toy_regression, "fit_exact_gp", no_fit)
    (tmp_path / "taken").write_text("a file")
    with pytest.raises(FileExistsError):
        run_toy_regression(SMOKE, out=tmp_path / "taken", progress=False)
