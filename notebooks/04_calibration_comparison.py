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
# # 04 · Calibration, robustness and cost: KEP-SVGP against the other attentions
#
# `gpattn.comparison` trains the same small Transformer with every attention of the registry in its last
# block (the first block uses softmax attention, as in the KEP-SVGP and SGPA papers) and evaluates the Monte Carlo
# predictive distribution $p(y \mid x) \approx \frac1T \sum_{t=1}^T \operatorname{softmax}(\text{logits}^{(t)})$:
#
# | name | attention |
# |---|---|
# | `kep_svgp` | KEP-SVGP: asymmetric cosine kernel, left/right kernel-eigen SVGP pair (amortised features) |
# | `kep_svgp_sym` | its symmetric ablation, $W_q = W_k$, one branch |
# | `sgpa` | SGPA (Chen & Li 2023): symmetric kernel, decoupled SVGP with amortised and global inducing keys |
# | `svgp` | a standard whitened GPyTorch SVGP per head on the projected tokens |
# | `softmax` | deterministic scaled dot-product attention |
# | `primal` | Primal-Attention: deterministic KSVD scores with the KSVD penalty |
#
# on two tasks: the **pointer** task (does token `a` come before token `b`? variable lengths 4-8) and
# scikit-learn's **digits** (8x8 images as 16 patches of 2x2, 8 classes; the digits 8 and 9 are held out as
# semantic OOD, structured noise images as a second OOD set; Gaussian noise, rotation and blur at severities 1-5
# as covariate shift). The metrics, all on the test set:
#
# * accuracy, NLL $-\frac1n \sum_i \log p(y_i \mid x_i)$, Brier score
#   $\frac1n \sum_i \|p(\cdot \mid x_i) - e_{y_i}\|^2$;
# * expected calibration error over 15 equal-width confidence bins $B_b$,
#   $\mathrm{ECE} = \sum_b \frac{|B_b|}{n} \,|\operatorname{acc}(B_b) - \operatorname{conf}(B_b)|$;
# * selective prediction: AURC and the AUROC/FPR95 of the confidence at separating errors from correct
#   predictions;
# * OOD detection: AUROC of the maximum probability at separating in-distribution from OOD inputs.
#
# **Size of this run.** `gpattn compare --full` uses 5 seeds per row (10 for KEP-SVGP and softmax) on MNIST-1D and
# digits, each row in its tuned configuration. To keep this notebook short it
# runs these six attentions (the registry also holds CGPT and the papers' configurations `kep_svgp_paper`,
# `primal_paper`) on the pointer task and digits with **2 seeds** (0 and 1) and otherwise the defaults: 8 epochs on the pointer task, 40 on digits, 10 Monte Carlo samples, each
# layer's default inducing-set size (`num_inducing=None`: KSVD rank $s = 10$ for KEP-SVGP and Primal-Attention, 16
# inducing keys or points for SGPA and the SVGP). With 2 seeds, "mean ± std" is a rough indication only: treat
# differences smaller than the spread as noise.

# %% [markdown]
# `_notebook_size.py` (next to the notebooks) reads `GPATTN_NOTEBOOK_SIZE`: `full` (default) gives the results
# discussed in the text, `smoke` (used by the test suite) shrinks every loop so that the notebook runs in seconds;
# its numbers are then meaningless. `%matplotlib inline` comes *after* the gpattn imports because `gpattn.plotting`
# selects the headless Agg backend when it is imported.

# %%
from _notebook_size import SIZE, pick, setup, style

setup()  # seed 0, one torch thread, quiet tqdm

import statistics
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch
from IPython.display import Markdown, display

from gpattn.attention import attention_names, build_attention
from gpattn.comparison import CompareConfig, markdown_table, run_comparison, write_outputs
from gpattn.plotting import (
    plot_ood_histograms,
    plot_reliability_diagrams,
    plot_shift_curves,
    plot_spectra,
    write_comparison_figures,
)

# %matplotlib inline
style()
print(f"notebook size: {SIZE}")

# %% [markdown]
# ## 1. Run the comparison
#
# `CompareConfig` holds the settings; `run_comparison` returns one typed `RunRecord` per (task, attention, seed)
# with the metrics and everything the figures need; `markdown_table` summarises them; `write_outputs` writes
# `results.json`, `results.csv` and `table.md`, and `write_comparison_figures` the figures of `gpattn compare`, to a
# folder (a temporary one here). This tour trains every row with the same shared settings (`tuned=False`: one width,
# learning rate and schedule, the epochs given here), which keeps it short and the rows on one footing; `gpattn
# compare` itself uses each row's tuned configuration where the package has one (`gpattn/comparison/tuned/`, digits
# and MNIST-1D), and the tuned protocol's comparison is notebook 06 and the results page of the user guide.

# %%
config = CompareConfig(
    attentions=pick(["kep_svgp", "kep_svgp_sym", "sgpa", "svgp", "softmax", "primal"], ["kep_svgp", "primal", "softmax"]),
    tasks=("pointer", "digits"),
    seeds=pick((0, 1), (0,)),
    pointer_epochs=pick(8, 1),
    digits_epochs=pick(40, 1),
    eval_samples=pick(10, 2),
    progress=False,
    tuned=False,  # the shared settings for every row (see above)
)
print(config)
start = time.perf_counter()
records = run_comparison(config)
print(f"{len(records)} runs in {time.perf_counter() - start:.0f} s")

out = Path(tempfile.mkdtemp(prefix="gpattn-compare-"))
written = write_outputs(records, config, out) + write_comparison_figures(records, out)
print("written:", ", ".join(path.name for path in written))
display(Markdown(markdown_table(records)))

# %% [markdown]
# The 24 runs took 285 s in this execution (one torch thread, 2 cores with almost nothing else running). Each run also
# has its temperature-scaled `+ts` row (temperature fitted on the validation split), and the table ends with the paired
# differences of KEP-SVGP against every row, which with 2 seeds print no interval (`n = 2 < 5`).
#
# *Pointer task:* KEP-SVGP, the SVGP and softmax solve it with both seeds (test accuracy 100%), Primal-Attention
# nearly (99.8 ± 0.3%) and the symmetric KEP ablation 99.1 ± 1.2%. SGPA, trained with its paper's per-sequence KL
# weight and KL annealing, solves it with one seed only (90.3 ± 13.7%): 8 epochs are short for its annealed KL. The
# rows that solve it are slightly under-confident (confidence − accuracy −0.11 to −0.28 points, ECE 0.11-0.28%). Their
# `+ts` rows show what temperature scaling does when the validation split has no error at all: the validation NLL
# keeps falling as $T \to 0$, the fit stops at its lower bound 0.01 ("2 of 2 at the fit's lower bound"), and the
# tempered model is certain of everything; harmless here (the test set has no error either), harmful wherever it does.
#
# *Digits* (8 classes, every row with the same shared settings): accuracy 97.1% for softmax, 96.7% for the symmetric
# ablation, 96.3% for Primal-Attention, 95.3% for the SVGP and 94.9% for KEP-SVGP and SGPA; softmax also has the lowest
# NLL (0.090; KEP-SVGP 0.176, the highest) and ECE (1.75%; KEP-SVGP 2.47%, SGPA 3.07%); by the debiased calibration
# error, which removes most of the binning bias, KEP-SVGP's 0.00 is below softmax's 1.90 (both within their spread).
# Temperature scaling (mean fitted T per row 0.79-1.13) lowers the ECE of the symmetric ablation (2.32 to 1.32%) and of
# SGPA (3.07 to 1.95%), raises softmax's (1.75 to 2.10%) and barely moves the clean NLLs; under shift it costs several
# rows (shift NLL: SGPA 1.47 to 1.91, the ablation 1.48 to 1.69, the SVGP 1.60 to 1.87). Under shift (mean over 3 kinds x
# 5 severities) every untempered row's NLL rises to 1.47-1.84 and its ECE to 19.5-27.0%: none is robust, KEP-SVGP
# (1.50, 21.0%) in the middle, Primal-Attention worst. With the shared settings and two seeds KEP-SVGP is behind softmax
# in accuracy, NLL, ECE and Brier here, and the stds are as large as many of the gaps: the ordering is a first look,
# not a result; the tuned, seeded comparison is notebook 06 and docs/guide/results.md (on digits, tuned, with 10 seeds:
# no difference detected between KEP-SVGP + temperature scaling and softmax + temperature scaling in test NLL).
#
# ## 2. Reliability diagrams
#
# Each panel bins the test predictions by confidence (the maximum probability) and shows the accuracy in each
# bin, with the number of predictions per bin below; hatched bars are the gap to the bin's mean confidence, the
# diagonal is perfect calibration. Bins are pooled over seeds; the title gives the ECE (mean ± std over seeds).
# **What to look for:** bars below the diagonal (over-confidence) in the high-confidence bins, which hold most
# predictions.

# %%
plot_reliability_diagrams(records, "digits")
plt.show()

# %%
plot_reliability_diagrams(records, "pointer")
plt.show()

# %% [markdown]
# On both tasks most predictions sit in the top confidence bins, which decide the ECE; the bins below about 0.9 hold
# few predictions (the count under each panel), so their bars are noisy. The ECEs in the titles are the table's:
# on digits from 1.75% (softmax) to 3.07% (SGPA); on the pointer task SGPA's seed without the task has most of its
# predictions in the low bins.
#
# ## 3. Metrics under covariate shift (digits)
#
# Accuracy, ECE and NLL against the severity of Gaussian noise, rotation and blur (severity 0 = the clean test
# set), mean ± std band over seeds. **What to look for:** how fast accuracy drops, and whether the
# calibration error grows with it (a well-calibrated model loses confidence as it loses accuracy).

# %%
plot_shift_curves(records)
plt.show()

# %% [markdown]
# Accuracy falls with severity for every attention, and the calibration error grows with it: no attention loses
# confidence as fast as it loses accuracy. Averaged over the three kinds and five severities the shift NLL runs
# from 1.47 (softmax, SGPA; the symmetric ablation 1.48) to 1.84 (Primal-Attention), KEP-SVGP 1.50, and the shift
# ECE from 19.5% (the symmetric ablation) to 27.0% (Primal-Attention), KEP-SVGP 21.0%. Within the seed bands the curves mostly overlap:
# at this size the GP attentions do not buy robustness to these shifts.
#
# ## 4. Out-of-distribution detection (digits)
#
# Densities of the maximum predicted probability on the in-distribution test set, on the held-out digits 8 and 9,
# and on structured noise images, on a log density axis. **What to look for:** OOD mass at low confidence, separated
# from the in-distribution peak near 1; the titles give both AUROCs.

# %%
plot_ood_histograms(records)
plt.show()

# %% [markdown]
# For every attention the in-distribution scores pile up at 1, and so do many held-out digits: a large share of
# the 8s and 9s is classified with near certainty as some other digit, which bounds every AUROC. By the maximum
# probability softmax separates the OOD sets best (pooled AUROC 88.6%; held-out digits 87.3%, noise 89.8%), then the
# symmetric ablation (87.6%), Primal-Attention (87.1%), the SVGP (86.7%), KEP-SVGP (85.5%) and SGPA (84.9%); scoring the
# stochastic rows by the mutual information of their Monte Carlo samples instead does not help them here (KEP-SVGP
# 83.1%, the ablation 87.2%). The differences are a few points, of the order of the seed spread.
#
# ## 5. Learned KSVD spectra
#
# The attentions with learned singular values (KEP-SVGP and its symmetric ablation with amortised features,
# Primal-Attention) keep a $\Lambda$ per head; `plot_spectra` shows them per task (mean over seeds).
# **What to look for:** how many directions each head uses: a flat spectrum uses all $s = 10$, a steep one only
# a few.

# %%
figure = plot_spectra(records)
for axis in figure.axes:  # the learned spectra span less than a factor 2: a linear axis reads better
    axis.set_yscale("linear")
plt.show()

# %% [markdown]
# Compare the learned $\Lambda$ with the fast-falling exact spectra of the attention kernels in notebook 03. The
# table's KSVD-fidelity block measures the gap directly: on digits the relative KSVD objective of the trained layers is
# 0.91 (KEP-SVGP), 0.81 (its ablation) and 0.84 (Primal-Attention), far from the 0 of a stationary point; the
# principal-angle cosines of the learned scores with the kernel's top-$s$ subspace are 0.96 for all three, against 0.84
# (0.70 for the ablation) at initialisation and 0.72 for random subspaces, while the kernels' effective rank is about 2:
# the learned scores span roughly the right subspaces without being their KSVD.
#
# ## 6. Cost per attention
#
# Two views of cost: the training time of each run as recorded by the runner (whole model, all epochs, CPU), and
# a micro-benchmark of one attention layer alone: the median time of a training step
# `(layer(x).sum() + layer.kl_divergence()).backward()` on a batch of 64 sequences of width 32 (2 heads), at the
# lengths of the two tasks (8 tokens, 16 patches) and at 64 tokens, layers interleaved so that load drifts hit
# all of them alike. **What to look for:** the price of the GP attentions relative to softmax, and how it
# grows with the sequence length.

# %%
names = list(dict.fromkeys(record.attention for record in records))
tasks = list(dict.fromkeys(record.task for record in records))
train_seconds = {(task, name): statistics.fmean(r.train.seconds for r in records
                                                if r.task == task and r.attention == name)
                 for task in tasks for name in names}

def make_layer(name):
    torch.manual_seed(0)
    return build_attention(name, config.embed_dim, config.num_heads, **config.attention_arguments(name)).train()

lengths = (8, 16, 64)
repeats = pick(15, 2)
step_times = {(name, length): [] for name in names for length in lengths}
for length in lengths:
    layers = {name: make_layer(name) for name in names}
    x = torch.randn(config.batch_size, length, config.embed_dim)
    for repeat in range(repeats + 1):  # the first round warms up and is dropped
        for name, layer in layers.items():
            layer.zero_grad(set_to_none=True)
            start = time.perf_counter()
            (layer(x).sum() + layer.kl_divergence()).backward()
            if repeat:
                step_times[name, length].append(time.perf_counter() - start)
step_ms = {key: 1000 * statistics.median(values) for key, values in step_times.items()}

print(f"{'attention':<14}" + "".join(f"{'train s ' + task:>16}" for task in tasks)
      + "".join(f"{f'step ms N={n}':>14}" for n in lengths) + f"{'x softmax N=64':>16}")
for name in names:
    print(f"{name:<14}" + "".join(f"{train_seconds[task, name]:>16.1f}" for task in tasks)
          + "".join(f"{step_ms[name, n]:>14.2f}" for n in lengths)
          + f"{step_ms[name, 64] / step_ms['softmax', 64]:>16.1f}")

figure, axes = plt.subplots(1, 2, figsize=(13, 3.8), layout="constrained")
positions = np.arange(len(names))
for axis, groups, label in ((axes[0], tasks, "task"), (axes[1], lengths, "sequence length")):
    width = 0.8 / len(groups)
    for offset, group in enumerate(groups):
        values = [train_seconds[group, name] if label == "task" else step_ms[name, group] for name in names]
        axis.bar(positions + (offset - (len(groups) - 1) / 2) * width, values, width,
                 label=group if label == "task" else f"N = {group}")
    axis.set_xticks(positions, names, rotation=20)
    axis.set_xlabel("attention")
    axis.legend(title=label)
    axis.grid(alpha=0.3, axis="y")
axes[0].set(ylabel="seconds per run", title="Training time of a whole model (mean over seeds)")
axes[1].set(ylabel="ms per step", yscale="log",
            title=f"One layer, forward + backward, batch {config.batch_size} (median of {repeats})")
plt.show()

# %% [markdown]
# These timings were taken with almost nothing else running on the 2 cores. 40 epochs on digits (one thread) took 6.1 s
# with softmax attention, 8.1 s with Primal-Attention, 11.1 s with the symmetric KEP ablation, 12.5 s with KEP-SVGP,
# 13.4 s with SGPA and 29.7 s with the GPyTorch SVGP. The layer micro-benchmark shows where this comes from: at the
# short lengths of these tasks KEP-SVGP is overhead-bound (about 5.4 times softmax at $N = 8$ and 4.0 times at
# $N = 16$: two variational distributions per head and their covariance roots), but its cost grows slowly with $N$
# (1.5 times softmax at $N = 64$: scores in $O(N p s)$, no $N \times N$ matrix), while SGPA (4.4 times softmax at
# $N = 64$) and the per-head SVGP (11.2 times) grow faster.
#
# **Summary.** With one shared configuration and two seeds, softmax attention is the most accurate row on digits and
# the best calibrated by NLL and ECE, KEP-SVGP among the least (NLL 0.176 against 0.090); none of the attentions stays calibrated under
# covariate shift, and temperature scaling fitted on a validation split without errors (the pointer task) drives $T$ to
# its bound. Untuned rows on two seeds compare the configuration as much as the attention: the tuned comparison with
# paired intervals (`gpattn compare --full`, docs/guide/results.md) is the place for conclusions.
