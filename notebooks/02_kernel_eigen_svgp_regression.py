# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 02 · Kernel-eigen SVGP regression: the left/right pair against an exact GP
#
# An asymmetric kernel $\kappa$ on landmarks $Z$ (queries = keys = $Z$ here) defines two weight-space GPs:
#
# $$f_e(x) = \kappa(x, Z)\, w, \quad k_e(x, x') = \kappa(x, Z) \kappa(x', Z)^\top; \qquad
#   f_r(x) = \kappa(Z, x)^\top w', \quad k_r(x, x') = \kappa(Z, x)^\top \kappa(Z, x'),$$
#
# with $w, w' \sim \mathcal N(0, I)$. KEP-SVGP (Chen et al., ICML 2024) uses the projections on the KSVD
# singular vectors as inducing variables, $u_e = H_e^\top f_e(Z)$ and $u_r = H_r^\top f_r(Z)$, for which, exactly,
#
# $$K_{uu} = \Lambda^2, \qquad K_{fu}(x) = e(x) \Lambda, \qquad
#   q(f_e(x)) = \mathcal N\big(e(x) \Lambda^{-1} m,\;
#   e(x) \Lambda^{-1} S \Lambda^{-1} e(x')^\top + [k_e(x, x') - e(x) e(x')^\top]\big)$$
#
# for $q(u_e) = \mathcal N(m, S)$: a diagonal $K_{uu}$, so the prior terms of the KL cost $O(s)$ and no Cholesky
# of $K_{uu}$ is ever needed. The bracket is the **residual** $K_{ff} - Q_{ff}$ (zero when the rank $s$ equals
# $\operatorname{rank} K$), kept on the diagonal (`residual="diag"`) or dropped (`"none"`, as in the paper).
# The right branch is the same with $r$, $H_r$. The model output is $F = f_e + f_r$, a GP with kernel
# $k_e + k_r$ whose exact posterior is the reference (`gpattn.kernels.InducedKernel` in a
# `gpytorch.models.ExactGP`). **Whitening** reparametrises $u = \Lambda v$, $v \sim \mathcal N(0, I)$.
#
# The data come from exactly this generating process: $f = f_{left} + f_{right}$ with a shifted RBF
# ($\delta = 0.6$), noise $\sigma = 0.1$, and a gap without training inputs on $[0.8, 1.6]$.
# This notebook fits `gpattn.models.KernelEigenPairSVGP` (a `gpytorch.models.ApproximateGP`) and shows
#
# 1. the data and its two components;
# 2. the left, right and merged posteriors after `VariationalELBO` training, against the exact GP;
# 3. the residual switched on and off;
# 4. a rank sweep (test RMSE and NLL against $s$);
# 5. whitened against unwhitened $q(u)$: training curves, and the same $q(f)$ for corresponding parameters;
# 6. training by Pyro SVI (`pyro_model` / `pyro_guide`).

# %% [markdown]
# `_notebook_size.py` (next to the notebooks) reads `GPATTN_NOTEBOOK_SIZE`: `full` (default) gives the results
# discussed in the text, `smoke` (used by the test suite) shrinks every loop so that the notebook runs in seconds;
# its numbers are then meaningless. `%matplotlib inline` comes *after* the gpattn imports because `gpattn.plotting`
# selects the headless Agg backend when it is imported.

# %%
from _notebook_size import SIZE, pick, setup, style

setup()  # seed 0, one torch thread, quiet tqdm

import time

import gpytorch
import matplotlib.pyplot as plt
import numpy as np
import torch

from gpattn.comparison import ToyRegressionConfig, fit_exact_gp, fit_pair_svgp, fit_pair_svgp_pyro
from gpattn.data import make_asymmetric_regression_1d
from gpattn.kernels import InducedKernel, ShiftedRBFKernel
from gpattn.models import KernelEigenPairSVGP
from gpattn.plotting import plot_pair_posterior

# %matplotlib inline
style()
torch.set_default_dtype(torch.float64)  # the data are float64; the identities of section 5 hold to ~1e-12
print(f"notebook size: {SIZE}")

# %% [markdown]
# ## 1. The data
#
# **What to look for:** the two components are bumps at the same sources, displaced by $\pm\delta$; only their
# sum is observed.

# %%
data = make_asymmetric_regression_1d(seed=0)
print(data.description)
print(f"{data.train_x.shape[0]} training and {data.test_x.shape[0]} test points, noise std {data.noise_std}, "
      f"shift {data.shift.tolist()}, lengthscale {data.lengthscale}")

figure, axis = plt.subplots(figsize=(12, 3.6), layout="constrained")
grid = data.grid_x.squeeze(-1)
axis.axvspan(0.8, 1.6, color="grey", alpha=0.15, lw=0, label="gap (no training data)")
axis.plot(grid, data.grid_f_left, color="C0", ls="--", label="$f_{left}(x) = \\sum_j w_j \\kappa(x, z_j)$")
axis.plot(grid, data.grid_f_right, color="C1", ls="--", label="$f_{right}(x) = \\sum_j w'_j \\kappa(z_j, x)$")
axis.plot(grid, data.grid_f, color="k", lw=2, label="$f = f_{left} + f_{right}$")
axis.scatter(data.train_x, data.train_y, s=8, color="k", alpha=0.5, label="training data")
axis.scatter(data.test_x, data.test_y, s=8, marker="x", color="C3", alpha=0.5, label="test data")
axis.set(xlabel="$x$", ylabel="$y$", title="Toy regression from an asymmetric generating process")
axis.legend(loc="center left", bbox_to_anchor=(1.01, 0.5))
plt.show()

# %% [markdown]
# ## 2. Left, right and merged posteriors against the exact GP
#
# `fit_pair_svgp` trains `KernelEigenPairSVGP(landmarks, ShiftedRBFKernel(1), num_inducing=16)` (24 fixed landmarks,
# natural-gradient steps on $q(u)$, Adam on the kernel and the noise) with `gpytorch.mlls.VariationalELBO`;
# `fit_exact_gp` fits the exact GP with kernel $k_e + k_r$ on the same landmarks by the exact marginal
# likelihood. Both start from $\delta = 0.1$, $\ell = 0.5$. We report the test RMSE and the negative log
# predictive density (NLPD, per test point, Gaussian predictive with the learned noise).

# %%
config = ToyRegressionConfig(iterations=pick(500, 15), pyro_iterations=pick(1500, 15))

def test_metrics(model, likelihood):
    with torch.no_grad():
        predictive = likelihood(model(data.test_x))  # marginals of y* = F(x*) + noise
        mean, variance = predictive.mean, predictive.variance
    rmse = (mean - data.test_y).pow(2).mean().sqrt().item()
    nlpd = (0.5 * torch.log(2 * torch.pi * variance) + (data.test_y - mean).pow(2) / (2 * variance)).mean()
    return {"rmse": rmse, "nlpd": nlpd.item()}

fits, results = {}, {}
for name, fit in {"exact GP": fit_exact_gp, "KEP-SVGP (ELBO)": fit_pair_svgp}.items():
    start = time.perf_counter()
    fits[name] = fit(data, config, progress=False)
    results[name] = {**test_metrics(*fits[name]), "seconds": time.perf_counter() - start}

exact_gp, exact_likelihood = fits["exact GP"]
kep, kep_likelihood = fits["KEP-SVGP (ELBO)"]
learned = {"exact GP": exact_gp.covar_module.kernel, "KEP-SVGP (ELBO)": kep.covar_module}
print(f"{'fit':<18}{'RMSE':>8}{'NLPD':>8}{'shift':>8}{'noise std':>11}{'seconds':>9}")
for name, row in results.items():
    noise = fits[name][1].noise.sqrt().item()
    print(f"{name:<18}{row['rmse']:>8.3f}{row['nlpd']:>8.3f}{learned[name].shift.item():>8.3f}"
          f"{noise:>11.3f}{row['seconds']:>9.1f}")

# %% [markdown]
# **What to look for** in the figure (`gpattn.plotting.plot_pair_posterior`): whether each branch recovers its
# generating component (up to swapping: a learned shift of the opposite sign explains $f_{left}$ with the right
# branch), how the bands widen in the gap, and whether the merged mean follows the exact GP's.

# %%
plot_pair_posterior(kep, data, exact_gp=exact_gp)
plt.show()


# %% [markdown]
# The merged posterior is the part the data determine: KEP-SVGP with $s = 16$ of 24 landmarks follows the exact
# GP's mean everywhere, including the gap (where it dips slightly below it), and reaches its test RMSE (0.122 vs
# 0.120). Its NLPD is worse (-0.55 vs -0.71) because the ELBO fit ends on a larger noise (std 0.17 against the
# true 0.10 and the exact GP's 0.11); section 4 shows that this noise estimate is not settled after a fixed
# number of steps. Its band in the gap is wider than the exact GP's.
#
# The branches are **not** identified: each posterior resembles its generating component only on parts of the
# line (the right one follows $f_{right}$ around its trough near $x = -0.8$ and its peak near 2.2, but has a
# bump near -1.8 where $f_{right}$ has a trough, and a dip in the gap that $f_{right}$ does not have). The
# learned shifts say why: the exact GP's marginal likelihood
# prefers $\delta = -2.08$, the ELBO fit $\delta = 0.74$, and both explain $f$ equally well. Nothing in the
# likelihood separates $f_e$ from $f_r$; only the prior does, and with landmarks on a dense regular grid the
# induced kernels $k_e$, $k_r$ are nearly stationary in the interior whatever $\delta$ is. What $\delta$ changes
# is *where* each branch has prior variance. **What to look for** below: the prior standard deviation
# $\sqrt{k_e(x, x)}$ and $\sqrt{k_r(x, x)}$ of each fitted model.

# %%
def branch_prior_std(kernel, side):
    # sqrt(k_e(x, x)) (left) or sqrt(k_r(x, x)) (right) of the kernel's induced GP on the 24 landmarks
    induced = InducedKernel(kernel, torch.linspace(-3, 3, config.num_landmarks).unsqueeze(-1), side=side)
    with torch.no_grad():
        return induced(data.grid_x, diag=True).sqrt()

figure, axis = plt.subplots(figsize=(11, 3.6), layout="constrained")
for (name, kernel), color in zip(learned.items(), ("C3", "C2")):
    for side, style in (("left", "-"), ("right", "--")):
        axis.plot(data.grid_x, branch_prior_std(kernel, side), color=color, ls=style,
                  label=f"{name} ($\\delta$ = {kernel.shift.item():.2f}): {side} branch")
    print(f"{name:<16} shift {kernel.shift.item():+.3f}, lengthscale {kernel.lengthscale.item():.3f}, "
          f"outputscale {kernel.outputscale.item():.3f}")
axis.axvspan(0.8, 1.6, color="grey", alpha=0.15, lw=0)
axis.set(xlabel="$x$", ylabel="prior std of the branch",
         title="Where each branch can put mass: $\\sqrt{k_e(x, x)}$ (solid), $\\sqrt{k_r(x, x)}$ (dashed)")
axis.legend(loc="center left", bbox_to_anchor=(1.01, 0.5))
plt.show()

# %% [markdown]
# With $\delta = -2.08$ the exact GP's left branch has its landmark bumps at $z_j + \delta \in [-5.1, 0.9]$ and
# covers only the left part of the line, the right branch ($z_j - \delta \in [-0.9, 5.1]$) only the right part:
# the marginal likelihood uses the shift to split the input range between the branches, not to reproduce the
# generating decomposition. The ELBO fit's smaller shift leaves both branches active almost everywhere. The sum
# $k_e + k_r$, and hence the merged posterior, hardly depends on this choice. Recovering the two components
# would need landmarks (sources) as sparse as those of the generating process, or prior knowledge of $\delta$.

# %% [markdown]
# ## 3. The residual $K_{ff} - Q_{ff}$ on and off
#
# At low rank the $s$ projections cannot carry the whole prior, and dropping the residual
# (`residual="none"`) removes prior variance: the model becomes a degenerate GP with $s$ basis functions per
# branch. A small training helper (natural gradients on $q(u)$, Adam on the rest, as `fit_pair_svgp` does)
# lets us vary rank, residual and parametrisation. **What to look for:** at $s = 4$, the predictive standard
# deviation with and without the residual, against the exact GP's.

# %%
landmarks = torch.linspace(-3, 3, config.num_landmarks).unsqueeze(-1)
num_data = data.train_x.shape[0]

def fit_kep(rank, residual="diag", whiten=False, iterations=config.iterations, natural=True, lr=config.lr):
    # KEP-SVGP trained on the ELBO; returns model, likelihood and -ELBO/n of every step
    torch.manual_seed(0)
    kernel = ShiftedRBFKernel(1, shift=config.initial_shift, lengthscale=config.initial_lengthscale)
    model = KernelEigenPairSVGP(landmarks, kernel, num_inducing=rank, residual=residual, whiten=whiten,
                                variational_distribution="natural" if natural else "cholesky",
                                learn_inducing_locations=False)
    likelihood = gpytorch.likelihoods.GaussianLikelihood()
    mll = gpytorch.mlls.VariationalELBO(likelihood, model, num_data=num_data)
    if natural:
        optimizers = [gpytorch.optim.NGD(model.variational_parameters(), num_data=num_data, lr=config.ngd_lr),
                      torch.optim.Adam([*model.hyperparameters(), *likelihood.parameters()], lr=lr)]
    else:
        optimizers = [torch.optim.Adam([*model.parameters(), *likelihood.parameters()], lr=lr)]
    model.train()
    likelihood.train()
    losses = []
    for _ in range(iterations):
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss = -mll(model(data.train_x), data.train_y)
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
        losses.append(loss.item())
    model.eval()
    likelihood.eval()
    return model, likelihood, losses

low_rank = 4
residual_fits = {residual: fit_kep(low_rank, residual=residual) for residual in ("diag", "none")}
grid_x = data.grid_x
with torch.no_grad():
    exact_std = exact_gp(grid_x).stddev
figure, (left, right) = plt.subplots(1, 2, figsize=(13, 3.8), layout="constrained")
left.scatter(data.train_x, data.train_y, s=6, color="k", alpha=0.4, label="training data")
right.plot(grid_x, exact_std, color="k", lw=2, label="exact GP")
for (residual, (model, likelihood, _)), color in zip(residual_fits.items(), ("C0", "C3")):
    with torch.no_grad():
        posterior = model(grid_x)
    mean, std = posterior.mean, posterior.stddev
    left.plot(grid_x, mean, color=color, label=f'residual="{residual}" mean')
    left.fill_between(grid_x.squeeze(-1), mean - 2 * std, mean + 2 * std, color=color, alpha=0.2,
                      label=f'residual="{residual}" $\\pm 2\\sigma$')
    right.plot(grid_x, std, color=color, label=f'residual="{residual}"')
    metrics = test_metrics(model, likelihood)
    print(f'rank {low_rank}, residual="{residual}": test RMSE {metrics["rmse"]:.3f}, '
          f'NLPD {metrics["nlpd"]:.3f}, noise std {likelihood.noise.sqrt().item():.3f}, '
          f"lengthscale {model.covar_module.lengthscale.item():.3f}")
for axis in (left, right):
    axis.axvspan(0.8, 1.6, color="grey", alpha=0.15, lw=0)
    axis.set_xlabel("$x$")
    axis.legend(fontsize=7, loc="upper left")
left.set(ylabel="$F(x)$", title=f"Merged posterior $q(F)$ at rank $s = {low_rank}$")
right.set(ylabel="posterior std of $F(x)$", title="Latent predictive standard deviation")
plt.show()

# %% [markdown]
# Four singular functions per branch cannot follow a function with a dozen bumps, and the two variants fail in
# different ways. Without the residual, shrinking the lengthscale costs nothing, so the fit does exactly that:
# the score functions $e_i(x) = \kappa(x, Z) H_r[:, i]$ become sums of narrow bumps on the landmarks (the learned
# lengthscale is 0.09, about a third of the landmark spacing) and the mean oscillates at the landmark spacing,
# with a latent std that oscillates with it between about 0.05 and 0.15 (test RMSE 0.415, NLPD 0.55, noise std
# 0.45). With the residual, a short lengthscale would leave most prior variance $k(x, x) - \|e(x)\|^2$
# unexplained and inflate the predictive variance everywhere, so the fit keeps a smooth, low-frequency mean
# (lengthscale 0.47) and a wide band whose latent std is 0.16 to 0.20 everywhere, the gap included (RMSE 0.56,
# NLPD 0.87, noise std 0.44). The exact GP's latent std is about 0.03 outside the gap (up to 0.06 at the ends)
# and rises to 0.16 inside it. The residual acts as a regulariser on the kernel hyperparameters, not only as extra
# variance, but here the regularised fit is the worse of the two on the test set: the narrow bumps of the fit
# without it follow the data better (RMSE 0.415 against 0.563, NLPD 0.55 against 0.87). Both are far from the
# exact GP (RMSE 0.12): $s = 4$ is simply too small here. (These low-rank fits are sensitive to float rounding, and
# the numbers are those of this run: an execution of the same code on another machine gave the fit without the
# residual RMSE 0.418, NLPD 0.57 and noise std 0.49, and 0.415/0.57 at $s = 4$ in the sweep below.)
#
# ## 4. Rank sweep
#
# The rank $s$ trades cost ($O(N s^2)$ per prediction, $O(s^3)$ for the KL) against fidelity. **What to look
# for:** where the test RMSE and NLPD reach the exact GP's, and how the residual changes the low-rank end.

# %%
ranks = pick([1, 2, 4, 8, 12, 16, 24], [2, 8])
sweep = {residual: [] for residual in ("diag", "none")}
start = time.perf_counter()
for residual in sweep:
    for rank in ranks:
        model, likelihood, _ = fit_kep(rank, residual=residual, iterations=pick(300, 10))
        sweep[residual].append(test_metrics(model, likelihood))
print(f"{2 * len(ranks)} fits in {time.perf_counter() - start:.1f} s")
for residual, rows in sweep.items():
    print(f'residual="{residual}": ' + ", ".join(
        f"s={rank}: {row['rmse']:.3f}/{row['nlpd']:.2f}" for rank, row in zip(ranks, rows)) + "  (RMSE/NLPD)")

figure, axes = plt.subplots(1, 2, figsize=(12, 3.8), layout="constrained")
for axis, key, label in zip(axes, ("rmse", "nlpd"), ("test RMSE", "test NLPD (nats per point)")):
    for (residual, rows), marker in zip(sweep.items(), "os"):
        axis.plot(ranks, [row[key] for row in rows], marker=marker, label=f'KEP-SVGP, residual="{residual}"')
    axis.axhline(results["exact GP"][key], color="k", ls="--", lw=1, label="exact GP ($k_e + k_r$)")
    axis.set(xlabel="rank $s$ (of 24 landmarks)", ylabel=label, title=f"{label} against the KSVD rank")
    axis.set_xticks(ranks)
    axis.grid(alpha=0.3)
    axis.legend()
plt.show()

# %% [markdown]
# Below $s = 8$ both variants fail (RMSE 0.45 to 0.76 against 0.12); from $s = 8$ on their RMSE is within 20% of
# the exact GP's (0.135 and 0.144 at $s = 8$), and from $s = 12$ on within 6% (0.125 to 0.127; NLPD -0.63 to
# -0.68 at $s = 12$ and 16, against -0.71). The top singular functions carry almost all of the kernel: notebook
# 01 found 7-8 singular values for 99% of $\|K\|_F^2$ at a similar lengthscale. At full rank ($s = 24$) the
# residual vanishes and the two variants coincide (RMSE 0.119, NLPD -0.52 for both). That NLPD is worse than at
# $s = 12$ and 16 although the RMSE equals the exact GP's, so the difference lies in the predictive variance:
# the learned noise of these fits is not settled after a fixed number of steps. The $s = 16$ fit shows it within
# this notebook: after 300 steps here its NLPD is -0.68, after the 500 steps of section 2 -0.55 (noise std
# 0.17). (A check outside the notebook: the $s = 24$ fit ends on noise std 0.18 after 300 steps, and on 0.12
# with NLPD -0.71, the exact GP's, after 500.)
# Where the truncation matters the residual does not help uniformly: it gives the better NLPD at $s = 1, 2, 8$
# and 12 ($s = 8$: -0.60 against -0.46), but the worse one at $s = 4$ (0.87 against 0.62), for the reason
# section 3 showed. At $s = 4$ the variant with the residual lands where the 500 steps of section 3 put it
# (RMSE/NLPD 0.564/0.87 against 0.563/0.87); the one without is still moving after these 300 steps (0.449/0.62,
# against 0.415/0.55 after 500).
#
# ## 5. Whitened against unwhitened $q(u)$
#
# With $u = \Lambda v$ the prior on $v$ is $\mathcal N(0, I)$ and the mean is $e(x) m_v$; the family of
# $q(f)$ is the same. Plain gradient steps are not invariant to this reparametrisation, natural gradients are.
# We train both parametrisations with a Cholesky $q$ and Adam on all parameters (same learning rate), then check
# that a whitened model given the corresponding parameters, $m_v = \Lambda^{-1} m$ and
# $L_v = \Lambda^{-1} L$, predicts the same $q(f)$. **What to look for:** which curve descends faster.

# %%
iterations = pick(500, 10)
parametrisations = {whiten: fit_kep(16, whiten=whiten, natural=False, iterations=iterations, lr=0.02)
                    for whiten in (False, True)}
figure, axis = plt.subplots(figsize=(8, 3.8), layout="constrained")
for whiten, (model, likelihood, losses) in parametrisations.items():
    label = "whitened $q(v)$" if whiten else "unwhitened $q(u)$"
    axis.plot(losses, label=label)
    metrics = test_metrics(model, likelihood)
    print(f"{label:<20} final -ELBO per point {losses[-1]:.3f}, test RMSE {metrics['rmse']:.3f}, "
          f"NLPD {metrics['nlpd']:.3f}")
lowest = min(min(losses) for _, _, losses in parametrisations.values())
axis.set(xlabel="Adam step", ylabel="$-$ELBO / $n$", ylim=(lowest - 0.2, lowest + 3),
         title="Cholesky $q$, Adam (lr 0.02) on all parameters, rank 16 (first steps off the scale)")
axis.grid(alpha=0.3)
axis.legend()
plt.show()

# the whitened model with the parameters that correspond to the trained unwhitened one
unwhitened = parametrisations[False][0]
whitened = KernelEigenPairSVGP(landmarks, ShiftedRBFKernel(1), num_inducing=16, whiten=True,
                               learn_inducing_locations=False)
whitened.load_state_dict(unwhitened.state_dict())
whitened.eval()
with torch.no_grad():
    singular_values = unwhitened.features.singular_values
    # both branches at once: q(u) is stacked on its last batch dimension (left, right)
    q_u = unwhitened.variational_strategy._variational_distribution
    q_v = whitened.variational_strategy._variational_distribution
    q_v.variational_mean.copy_(q_u.variational_mean / singular_values)  # m_v = Lambda^{-1} m
    q_v.chol_variational_covar.copy_(q_u.chol_variational_covar.tril() / singular_values.unsqueeze(-1))
    a, b = unwhitened(data.grid_x), whitened(data.grid_x)
print(f"same q(f): max |mean difference| = {(a.mean - b.mean).abs().max():.1e}, "
      f"max |covariance difference| = {(a.covariance_matrix - b.covariance_matrix).abs().max():.1e}")

# %% [markdown]
# The whitened parametrisation descends much faster under the same optimiser: after 500 steps its $-$ELBO$/n$ is
# -0.44 (test RMSE 0.126, close to the natural-gradient fit) while the unwhitened one is still at +0.50 (RMSE
# 0.325). The singular values span orders of magnitude, and in the unwhitened coordinates the directions of small
# $\lambda_i$ have prior variance $\lambda_i^2$, so a step of fixed size is badly scaled there. Both curves show
# occasional spikes, Adam steps that the kernel hyperparameters overshoot. The two parametrisations describe the
# same family: mapped parameters give the same predictive mean and covariance to ~1e-16. Natural gradients (the
# recipe of `fit_pair_svgp`) are invariant to the reparametrisation and make the choice moot.
#
# ## 6. Pyro SVI
#
# `KernelEigenPairSVGP.pyro_model` and `pyro_guide` expose the inducing variables of both branches as Pyro sample
# sites, so the model also trains with `pyro.infer.SVI` (here `TraceMeanField_ELBO`, analytic KL,
# reparameterised samples of $f$, whitened $q$, 1500 ClippedAdam steps; see `fit_pair_svgp_pyro`).
# **What to look for:** whether the stochastic fit lands on the same posterior as the natural-gradient fit.

# %%
start = time.perf_counter()
fits["KEP-SVGP (Pyro SVI)"] = fit_pair_svgp_pyro(data, config, progress=False)
results["KEP-SVGP (Pyro SVI)"] = {**test_metrics(*fits["KEP-SVGP (Pyro SVI)"]),
                                  "seconds": time.perf_counter() - start}
print(f"{'fit':<22}{'RMSE':>8}{'NLPD':>8}{'shift':>8}{'noise std':>11}{'seconds':>9}")
for name, row in results.items():
    model, likelihood = fits[name]
    kernel = model.covar_module.kernel if name == "exact GP" else model.covar_module
    print(f"{name:<22}{row['rmse']:>8.3f}{row['nlpd']:>8.3f}{kernel.shift.item():>8.3f}"
          f"{likelihood.noise.sqrt().item():>11.3f}{row['seconds']:>9.1f}")

figure, axes = plt.subplots(1, 2, figsize=(13, 3.8), sharey=True, layout="constrained")
for axis, name, color in zip(axes, ("KEP-SVGP (ELBO)", "KEP-SVGP (Pyro SVI)"), ("C2", "C4")):
    with torch.no_grad():
        posterior = fits[name][0](grid_x)
        exact_mean = exact_gp(grid_x).mean
    mean, std = posterior.mean, posterior.stddev
    axis.axvspan(0.8, 1.6, color="grey", alpha=0.15, lw=0)
    axis.fill_between(grid_x.squeeze(-1), mean - 2 * std, mean + 2 * std, color=color, alpha=0.25,
                      label="$\\pm 2\\sigma$ of $q(F)$")
    axis.plot(grid_x, mean, color=color, lw=2, label="mean of $q(F)$")
    axis.plot(grid_x, exact_mean, color="k", ls="--", lw=1, label="exact GP mean")
    axis.scatter(data.train_x, data.train_y, s=6, color="k", alpha=0.4, label="training data")
    axis.set(xlabel="$x$", title=f"{name}: RMSE {results[name]['rmse']:.3f}, NLPD {results[name]['nlpd']:.3f}")
    axis.legend(fontsize=7, loc="lower left")
axes[0].set_ylabel("$F(x)$")
plt.show()

# %% [markdown]
# Where there are data, SVI and the natural-gradient fit agree with each other and with the exact GP, and SVI's
# noise estimate is close to the exact GP's (std 0.115 against 0.109; the natural-gradient fit's is 0.172). In
# the gap they differ in this run: the SVI mean stays on the exact GP's (at most 0.04 below it), while the
# natural-gradient mean dips up to 0.11 below it (to about -0.66 against -0.58); both stay well inside their
# bands. SVI reaches the exact GP's test RMSE and NLPD (0.119 and -0.705 against 0.120 and -0.707), a better
# NLPD than the natural-gradient fit's (-0.55), mostly from the smaller noise. Single SVI runs are less
# reproducible than the deterministic natural-gradient fit, though: with seeds 1 and 2
# (`ToyRegressionConfig(seed=...)`, run outside this notebook, same data and settings) SVI reached test RMSEs of
# 0.160 and 0.129 and NLPDs of -0.50 and -0.25 (noise std 0.14 and 0.26), and the seed-1 mean dips to about
# $-0.92$ in the gap: Monte Carlo optimisation noise, not a different model. SVI also costs several times more
# (1500 Monte Carlo steps: 8.2 s here, against 1.4 s; timings vary with the machine's load), and its learned
# shift (1.169) differs again from the other fits: as section 2 showed, $\delta$ is not identified by these
# data. The same model object serves GPyTorch's `VariationalELBO` and Pyro's inference machinery.
