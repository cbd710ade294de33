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
# # 06 · MNIST-1D: calibration, shift and KSVD fidelity against the baselines practitioners use
#
# [MNIST-1D](https://github.com/greydanus/mnist1d) (Greydanus 2020, "Scaling down deep learning") is a published
# benchmark of length-40 sequences, ten classes, 4000 training and 1000 test sequences, generated locally by the
# `mnist1d` package with its default arguments (nothing is downloaded). `gpattn.experiments.load_task("mnist1d")`
# cuts every sequence into 10 tokens of 4 values, carves 10 % of the training sequences out for validation, and adds
#
# * **covariate shift** at severities 1-5: the test split regenerated from the same digit templates with one
#   generator parameter raised (i.i.d. noise, correlated noise, shear, translation, scale; the values are in
#   `gpattn.data.MNIST1D_SHIFT_PARAMETERS`), and the **spatially shuffled** test split as a separate shift;
# * **OOD**: 1000 sequences without a digit (flat templates, random templates, smooth noise).
#
# Every run is evaluated as trained and, for free, **temperature-scaled** (`+ts` rows: one temperature fitted by
# NLL on the validation split, applied to the same Monte Carlo logits); `softmax_mc_dropout` is the softmax
# Transformer trained with dropout 0.1 and evaluated with dropout on, as many passes as the GP layers' samples.
# For the KSVD layers (KEP-SVGP, Primal-Attention) every run also measures its **KSVD fidelity** on 256 test
# sequences: how close the learned scores are to the exact KSVD of the same attention kernel.
#
# **Size of this run.** One seed and three rows (KEP-SVGP, softmax, SGPA) plus their `+ts` rows, with the main
# job's settings otherwise (20 epochs, 10 Monte Carlo samples, KSVD rank 5). One seed shows the mechanics, not a
# result: the seed-paired comparison with intervals is `gpattn compare` (5 seeds; `docs/guide/results.md`).

# %%
from _notebook_size import SIZE, pick, setup, style

setup()  # seed 0, one torch thread, quiet tqdm

import time

import matplotlib.pyplot as plt
import numpy as np
from IPython.display import Markdown, display

from gpattn.data import MNIST1D_SHIFT_PARAMETERS
from gpattn.experiments import CompareConfig, load_task, markdown_table, train_and_evaluate, with_temperature_scaled
from gpattn.plotting import plot_fidelity, plot_reliability_diagrams, plot_shift_curves

# %matplotlib inline
style()
print(f"notebook size: {SIZE}")

# %% [markdown]
# ## 1. The data
#
# One sequence per class, as the Transformer sees it (10 tokens of 4 values, drawn back as the length-40 signal),
# and the same test sequence under each shift at severity 5.

# %%
task = load_task("mnist1d", test_size=pick(None, 60))
print(f"train {len(task.train)}, validation {len(task.val)}, test {len(task.test)} sequences")
print(f"tokens per sequence x values per token: {tuple(task.test.tokens.shape[1:])}")
print({kind: values for kind, values in MNIST1D_SHIFT_PARAMETERS.items()})

figure, axes = plt.subplots(1, 2, figsize=(11, 3))
signals = task.test.tokens.reshape(len(task.test), 40).numpy()
labels = task.test.labels.numpy()
for digit in range(10):
    row = int(np.flatnonzero(labels == digit)[0])
    axes[0].plot(signals[row] + 3 * digit, lw=1)
axes[0].set_title("one test sequence per class (offset by 3 per class)")
for kind in ("iid_noise", "correlated_noise", "shear", "translation", "scale", "shuffled"):
    severity = 1 if kind == "shuffled" else 5
    axes[1].plot(task.shifted[(kind, severity)].tokens[0].reshape(40).numpy(), lw=1, label=f"{kind} {severity}")
axes[1].plot(signals[0], color="black", lw=2, label="clean")
axes[1].legend(fontsize=7, ncol=2)
axes[1].set_title("test sequence 0 under each shift")
plt.show()

# %% [markdown]
# ## 2. Train and evaluate
#
# `train_and_evaluate(config, task, attention, seed)` is one run of `gpattn compare`; its `RunRecord` holds the
# metrics of the model as trained, of its `+ts` variant (`record.temperature_scaled`) and the KSVD fidelity
# (`record.fidelity`).

# %%
config = CompareConfig(
    attentions=("kep_svgp", "softmax", "sgpa"),
    tasks=("mnist1d",),
    seeds=(0,),
    mnist1d_epochs=pick(20, 1),
    eval_samples=pick(10, 2),
    fidelity_sequences=pick(256, 16),
    progress=False,
)
records = []
for attention in config.attentions:
    start = time.perf_counter()
    records.append(train_and_evaluate(config, "mnist1d", attention, 0, data=task))
    scaled = records[-1].temperature_scaled
    print(f"{attention}: {time.perf_counter() - start:.0f} s, temperature {scaled.temperature:.2f}")
display(Markdown(markdown_table(records)))

# %% [markdown]
# The table's text is in the last section. The published numbers (logistic regression 32 %, MLP 68 %, CNN 94 %,
# GRU 91 %, human 96 %) are the MNIST-1D README's, for other models on the same split; they place a two-block
# Transformer of width 32 between the MLP and the CNN.
#
# ## 3. Reliability diagrams, with and without temperature scaling
#
# `with_temperature_scaled(records)` turns every `+ts` variant into a record of its own, so that the figures draw
# it like any other row. **What to look for:** bars above the diagonal (under-confidence: the accuracy of a bin
# exceeds its confidence) or below it (over-confidence), and how the `+ts` panels move them.

# %%
plot_reliability_diagrams(with_temperature_scaled(records), "mnist1d")
plt.show()

# %% [markdown]
# ## 4. Shift curves
#
# Accuracy, ECE and NLL against the severity of each shift (severity 0 is the clean test split; the shuffled split
# is one point at severity 1), for the models as trained (the `+ts` rows' shift means are in the table).
# **What to look for:** whether the calibration error grows as the accuracy falls (a model that knows it is lost
# keeps its ECE low).

# %%
plot_shift_curves(records)
plt.show()

# %% [markdown]
# ## 5. KSVD fidelity
#
# For the KEP-SVGP layer, per head: the relative KSVD objective $|J|$ over the size of its terms (0 at a stationary
# point), the cosines of the principal angles between the learned score subspaces and the exact top-$s$ singular
# subspaces of the dense kernel of the same sequence (1: the same subspace), the largest angle, the error of the
# learned $\Lambda$ against the exact singular values, and the share of the kernel's energy in its top $s = 5$
# singular values. `gpattn.features.ksvd_fidelity(layer, tokens)` computes them for any KEP or Primal layer of your
# own model; `gpattn.experiments.model_fidelity(model, dataset)` does it for every such layer of a Transformer.

# %%
plot_fidelity(records)
plt.show()
for record in records:
    for layer, fields in record.fidelity.items():
        print(record.attention, layer, {name: np.round(values, 3).tolist() for name, values in fields.items()})

# %% [markdown]
# ## 6. What this run shows
#
# Written from the full-size execution of this notebook: **one seed**, so every difference below is a single
# draw, with no interval (the table says `n = 1 < 5, no interval`); the results page of the user guide has the
# 5-seed run.
#
# * **Accuracy.** Softmax 84.3 %, KEP-SVGP 83.1 %, SGPA 81.6 %: all between the published MLP (68 %) and CNN
#   (94 %) and below the GRU (91 %), published numbers of other models on the same split.
# * **Calibration.** All three are slightly *under*-confident on the clean test split (mean confidence below the
#   accuracy; fitted temperatures 0.90, 0.90 and 0.81, below 1, so scaling sharpens them). ECE: KEP-SVGP 2.35 %,
#   softmax 2.39 %, SGPA 5.54 %; temperature scaling helps where the miscalibration is largest (SGPA 3.31 %,
#   softmax 2.00 %) and not for KEP-SVGP (2.53 %): a temperature fitted on 399 validation sequences does not
#   transfer exactly. NLL 0.48 / 0.44 / 0.53 barely moves with scaling.
# * **Shift.** All three lose about 20 points of accuracy on average over the five shifts (62.7 %, 62.7 %,
#   59.5 %), and fall to 24-26 % on the shuffled split (the spatial order is what they learned). The ECE grows with
#   severity under the noises, shear and scale for every model; temperature scaling *raises* the shift ECE (KEP-SVGP 14.9 -> 16.8 %, softmax
#   15.4 -> 17.6 %): a temperature below 1 sharpens predictions that are already over-confident under shift.
# * **OOD** (noise sequences, maximum-probability AUROC): 72-73 % for KEP-SVGP and softmax, 68 % for SGPA; weak
#   for all.
# * **KSVD fidelity.** The trained KEP-SVGP layer is *not* a KSVD of its kernel on these sequences: the relative
#   KSVD objective is about 0.9 (0 at a stationary point), the learned score subspaces are up to about 50° away
#   from the exact top-5 singular subspaces (mean cosines about 0.95), and the learned singular values are far
#   from the exact ones (relative error about 0.98). The kernel itself is nearly of rank 5 on 10 tokens (top-5
#   energy 0.9996), so a rank-5 KSVD would represent it well; training with the KSVD penalty at weight 1 does not
#   get there in 20 epochs. This is in line with the 2025 reproduction study that found the kernel-PCA reading of
#   trained attention to fail under scrutiny.
