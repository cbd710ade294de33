r"""The 8 x 8 handwritten digits (scikit-learn's bundled copy of the UCI set) as a small real image benchmark for
calibration and out-of-distribution (OOD) detection, with CIFAR-10-C-style distribution shifts.

* :func:`load_digits_splits`: stratified, deterministic train / validation / test splits of the 1797 images
  (``float32 (n, 1, 8, 8)`` in ``[0, 1]``, the raw 0..16 grey levels divided by 16). By default the digits 8 and 9
  are *held out*: they are removed from the three splits (the remaining digits 0..7 keep their labels 0..7) and
  returned as a semantic OOD set ``ood_classes``. Holding out two classes is the usual "open-set" protocol; it leaves
  an 8-class in-distribution problem (about 1440 images) and about 350 OOD images of *unseen classes*, while the
  in-distribution test set stays available for accuracy and calibration. Pass ``held_out_classes=None`` for the
  plain 10-class problem (``ood_classes`` is then ``None``).
* :func:`shift_images` / :func:`make_shifted_test_sets`: covariate shift at five severities, in the spirit of
  CIFAR-10-C (Hendrycks & Dietterich, ICLR 2019). Parameters per severity (``SHIFT_PARAMETERS``):

  ==================  =====  =====  =====  =====  =====
  kind / severity       1      2      3      4      5
  ==================  =====  =====  =====  =====  =====
  ``gaussian_noise``  0.05   0.10   0.15   0.20   0.30   (additive noise std, on the ``[0, 1]`` scale)
  ``rotation``        10     20     30     45     60     (degrees; the sign is random per image)
  ``blur``            0.5    0.7    0.9    1.1    1.4    (Gaussian blur sigma, in pixels)
  ==================  =====  =====  =====  =====  =====

  Every output is clipped to ``[0, 1]``. Rotation uses ``affine_grid`` / ``grid_sample`` (bilinear, zero fill
  outside the image, about the image centre); blur is a separable normalised Gaussian kernel (radius
  ``ceil(3 sigma)``) applied with ``conv2d`` and replicate padding, so it preserves the mean up to border effects.
  The digits are low resolution (each pixel averages a 4 x 4 block of the original 32 x 32 bitmap), hence the larger
  noise and smaller blur than CIFAR-10-C's.
* :func:`make_noise_ood`: structured-noise OOD images (smooth random fields, Gaussian blobs, stripes) whose pixel
  intensities are remapped to the digits' intensity distribution, so that they cannot be flagged by brightness or
  contrast alone.
* :func:`~gpattn.data.patches.images_to_patches` / :func:`~gpattn.data.patches.patches_to_images` (re-exported
  here): non-overlapping patches as vectors ``(n, N, C p^2)`` for :class:`~gpattn.models.Transformer` with
  ``input="vectors"``. With ``input="patches"`` (``image_size=8, patch_size=p, in_channels=1``) the Transformer
  takes the images ``(n, 1, 8, 8)`` directly.

All randomness comes from local generators (``numpy.random.Generator`` for the splits, ``torch.Generator`` for the
shifts and the noise images) seeded with ``seed``; the global RNGs are never touched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ..validation import (
    InputTypeError,
    check_choice,
    check_digits,
    check_float,
    check_int,
    check_seed,
    check_sequence,
    check_tensor,
)
from .image_dataset import ImageDataset
from .patches import images_to_patches, patches_to_images

__all__ = [
    "DEFAULT_HELD_OUT_CLASSES",
    "SHIFT_KINDS",
    "SHIFT_PARAMETERS",
    "ImageSplits",
    "gaussian_blur",
    "images_to_patches",
    "load_digits_splits",
    "make_noise_ood",
    "make_shifted_test_sets",
    "patches_to_images",
    "rotate_images",
    "shift_images",
]

DEFAULT_HELD_OUT_CLASSES: tuple[int, ...] = (8, 9)
#: The distribution shifts of :func:`shift_images`, in the order of the comparison's figures.
SHIFT_KINDS: tuple[str, ...] = ("gaussian_noise", "rotation", "blur")
#: Parameter of each shift kind at severities 1 to 5: noise std (on the ``[0, 1]`` scale), rotation angle (degrees)
#: and blur sigma (pixels).
SHIFT_PARAMETERS: dict[str, tuple[float, ...]] = {
    "gaussian_noise": (0.05, 0.10, 0.15, 0.20, 0.30),  # noise std
    "rotation": (10.0, 20.0, 30.0, 45.0, 60.0),  # degrees
    "blur": (0.5, 0.7, 0.9, 1.1, 1.4),  # Gaussian sigma in pixels
}
NOISE_OOD_FAMILIES: tuple[str, ...] = ("smooth_field", "blobs", "stripes")


@dataclass(frozen=True)
class ImageSplits:
    """Train, validation and test :class:`ImageDataset` s, and the held-out classes as an OOD set.

    Attributes:
        train: Training split (in-distribution classes only).
        val: Validation split.
        test: Test split.
        ood_classes: All images of the held-out classes (labels index its own ``class_names``, e.g. ``("8", "9")``),
            or ``None`` when no class is held out.
        held_out_classes: The held-out original labels (digits), ``()`` when none.
        label_map: Original label (digit) -> in-distribution label, for the kept classes.
    """

    train: ImageDataset
    val: ImageDataset
    test: ImageDataset
    ood_classes: ImageDataset | None
    held_out_classes: tuple[int, ...]
    label_map: dict[int, int]


@lru_cache(maxsize=1)
def _digits_raw() -> tuple[np.ndarray, np.ndarray]:
    """The 1797 digits as ``float32 (n, 8, 8)`` in ``[0, 1]`` and ``int64 (n,)`` labels (bundled, no download;
    cached, read-only: index them to get writable copies)."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images, labels = (bunch.images / 16.0).astype(np.float32), bunch.target.astype(np.int64)
    images.flags.writeable = labels.flags.writeable = False
    return images, labels


def load_digits_splits(
    seed: int = 0,
    val_fraction: float = 0.15,
    test_fraction: float = 0.25,
    held_out_classes: tuple[int, ...] | None = DEFAULT_HELD_OUT_CLASSES,
    val_seed: int | None = None,
) -> ImageSplits:
    """Stratified train / validation / test splits of scikit-learn's 8 x 8 digits, with held-out OOD classes.

    Within every kept class the images are permuted by ``numpy.random.default_rng(seed)``; the first
    ``round(test_fraction n_c)`` go to test, the next ``round(val_fraction n_c)`` to validation, the rest to
    training; each split is then shuffled. With ``val_seed`` the images of a class that are not test images are
    permuted again, by ``numpy.random.default_rng(val_seed)`` (one generator for all classes), before the first
    ``round(val_fraction n_c)`` of them go to validation: the test split (its images and their order) is that of
    ``seed`` whatever ``val_seed`` is, and the validation split varies with ``val_seed``. The held-out classes are
    removed from all three splits, the kept digits are re-indexed ``0 .. K-1`` in increasing order (``label_map``),
    and every image of a held-out class goes to ``ood_classes`` (labels ``0 .. len(held_out_classes) - 1`` in the
    given order).

    :param seed: Seed of the local generator, in ``[0, 2**64 - 1]``.
    :param val_fraction: Fraction of every kept class for validation.
    :param test_fraction: Fraction of every kept class for test.
    :param held_out_classes: Digits to hold out as OOD (default ``(8, 9)``, leaving 8 classes); ``None`` or ``()``
        for the full 10-class problem.
    :param val_seed: Seed of the validation split's draw from the images that are not test images; ``None``
        (default): the permutation of ``seed`` decides it too. Seeds are in ``[0, 2**64 - 1]``.
    :return: The splits, the OOD set and the label mapping.
    """
    check_seed("seed", seed, where="load_digits_splits")
    if val_seed is not None:
        check_seed("val_seed", val_seed, where="load_digits_splits")
    # a NumPy float32 fraction (not a Python float) was refused as "expected val_fraction in [0, 1), got 0.1"
    val_fraction = check_float("val_fraction", val_fraction, 0.0, 1.0, strict_maximum=True, where="load_digits_splits")
    test_fraction = check_float(
        "test_fraction", test_fraction, 0.0, 1.0, strict_maximum=True, where="load_digits_splits"
    )
    if val_fraction + test_fraction >= 1:
        raise ValueError(f"expected val_fraction + test_fraction < 1, got {val_fraction} + {test_fraction}")
    held = check_digits("held_out_classes", held_out_classes)
    if len(set(held)) != len(held) or len(held) > 8:
        raise ValueError(f"expected at most 8 distinct held-out digits (2 classes must remain), got {held!r}")

    images, digits = _digits_raw()
    kept = [c for c in range(10) if c not in held]
    label_map = {digit: index for index, digit in enumerate(kept)}
    rng = np.random.default_rng(seed)
    val_rng = None if val_seed is None else np.random.default_rng(val_seed)
    parts: tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]] = ([], [], [])
    for digit in kept:
        members = rng.permutation(np.flatnonzero(digits == digit))
        n_test = round(test_fraction * len(members))
        n_val = round(val_fraction * len(members))
        parts[2].append(members[:n_test])
        rest = members[n_test:] if val_rng is None else val_rng.permutation(members[n_test:])
        parts[1].append(rest[:n_val])
        parts[0].append(rest[n_val:])
    missing = [digit for digit, chunk in zip(kept, parts[0], strict=True) if chunk.size == 0]
    if missing:  # large fractions round whole classes away
        raise ValueError(
            f"load_digits_splits: val_fraction={val_fraction}, test_fraction={test_fraction} leave no training image "
            f"of the digit(s) {missing}; use smaller fractions"
        )

    class_names = tuple(str(c) for c in kept)
    lookup = np.full(10, -1, dtype=np.int64)
    lookup[kept] = np.arange(len(kept))
    held_text = f", digits {', '.join(map(str, held))} held out" if held else ""
    datasets = []
    for name, chunks in zip(("train", "val", "test"), parts, strict=True):
        indices = rng.permutation(np.concatenate(chunks))
        seeds = f"seed {seed}" if val_seed is None or name == "test" else f"seed {seed}, validation seed {val_seed}"
        datasets.append(
            ImageDataset(
                torch.from_numpy(images[indices]).unsqueeze(1),
                torch.from_numpy(lookup[digits[indices]]),
                len(kept),
                class_names,
                f"sklearn 8x8 digits, {name} split ({seeds}){held_text}; labels index class_names",
            )
        )

    ood = None
    if held:
        indices = np.flatnonzero(np.isin(digits, held))
        ood_lookup = np.full(10, -1, dtype=np.int64)
        ood_lookup[list(held)] = np.arange(len(held))
        ood = ImageDataset(
            torch.from_numpy(images[indices]).unsqueeze(1),
            torch.from_numpy(ood_lookup[digits[indices]]),
            len(held),
            tuple(str(c) for c in held),
            f"sklearn 8x8 digits of the held-out classes {held} (semantic OOD); labels index class_names",
        )
    return ImageSplits(*datasets, ood_classes=ood, held_out_classes=held, label_map=label_map)


def _check_images(images: Tensor, where: str) -> None:
    # one elementwise pass (finiteness); shift_images checks once and calls the unchecked _rotate / _blur
    if not isinstance(images, Tensor):
        raise InputTypeError(f"{where}: expected images to be a torch.Tensor (n, C, H, W), got {type(images).__name__}")
    if not images.is_floating_point():
        raise InputTypeError(f"{where}: expected floating images (n, C, H, W), got {images.dtype}")
    check_tensor("images", images, ("n", "C", "H", "W"), finite=True, where=where)
    if 0 in images.shape[1:]:  # no pixel to rotate or blur; an empty batch (n = 0) is fine
        raise ValueError(
            f"{where}: expected images (n, C, H, W) with C, H and W at least 1, got shape {tuple(images.shape)}"
        )


def rotate_images(images: Tensor, degrees: float | Tensor) -> Tensor:
    """Rotate images about their centre by bilinear ``grid_sample``, filling outside with zeros.

    Positive angles turn the content counter-clockwise as displayed (row 0 at the top).

    :param images: ``(n, C, H, W)``, ``C, H, W >= 1`` (``n = 0`` gives an empty result).
    :param degrees: One finite angle (a number or a one-element tensor), or one per image ``(n,)``.
    :return: Rotated images ``(n, C, H, W)`` (not clipped; bilinear interpolation stays within the input range).
    """
    _check_images(images, "rotate_images")
    if isinstance(degrees, Tensor) and degrees.numel() != 1:  # one angle per image
        check_tensor("degrees", degrees, (images.shape[0],), finite=True, where="rotate_images")
        if degrees.dtype == torch.bool or degrees.is_complex():
            raise InputTypeError(f"rotate_images: expected real angles in degrees, got {degrees.dtype}")
    else:  # a NaN angle made every image NaN
        degrees = check_float(
            "degrees", degrees.item() if isinstance(degrees, Tensor) else degrees, where="rotate_images"
        )
    return _rotate(images, degrees)


def _rotate(images: Tensor, degrees: float | Tensor) -> Tensor:
    n, _, height, width = images.shape
    if n == 0:  # affine_grid refuses an empty batch
        return images.clone()
    angles = torch.as_tensor(degrees, dtype=images.dtype, device=images.device).expand(n) * (math.pi / 180)
    cos, sin = angles.cos(), angles.sin()
    zero = torch.zeros_like(cos)
    # rotation in pixel units, expressed in the normalised [-1, 1] coordinates of affine_grid (aspect corrected)
    theta = torch.stack(
        [torch.stack([cos, -sin * height / width, zero], -1), torch.stack([sin * width / height, cos, zero], -1)], 1
    )  # shape: (n, 2, 3)
    grid = F.affine_grid(theta, list(images.shape), align_corners=False)
    return F.grid_sample(images, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def gaussian_blur(images: Tensor, sigma: float) -> Tensor:
    """Blur every channel with a normalised separable Gaussian kernel of radius ``ceil(3 sigma)`` (replicate padding).

    :param images: ``(n, C, H, W)``, ``C, H, W >= 1``.
    :param sigma: Standard deviation in pixels, finite and ``>= 0`` (``0`` returns a copy).
    :return: Blurred images ``(n, C, H, W)``.
    """
    _check_images(images, "gaussian_blur")
    sigma = check_float("sigma", sigma, 0.0, where="gaussian_blur")  # an infinite sigma has no finite radius
    return _blur(images, sigma)


def _blur(images: Tensor, sigma: float) -> Tensor:
    if sigma == 0:
        return images.clone()
    channels = images.shape[1]
    radius = max(1, math.ceil(3 * sigma))
    offsets = torch.arange(-radius, radius + 1, dtype=images.dtype, device=images.device)
    kernel = torch.exp(-0.5 * (offsets / sigma) ** 2)
    kernel = kernel / kernel.sum()
    out = F.pad(images, (radius, radius, radius, radius), mode="replicate")
    out = F.conv2d(out, kernel.view(1, 1, 1, -1).expand(channels, 1, 1, -1), groups=channels)
    return F.conv2d(out, kernel.view(1, 1, -1, 1).expand(channels, 1, -1, 1), groups=channels)


def shift_images(images: Tensor, kind: str, severity: int, seed: int = 0) -> Tensor:
    """Apply a distribution shift of one kind and severity (see ``SHIFT_PARAMETERS``), clipped to ``[0, 1]``.

    ``gaussian_noise`` adds i.i.d. normal noise; ``rotation`` rotates every image by the severity's angle with a
    random sign per image; ``blur`` is deterministic (``seed`` unused). Random draws come from a local
    ``torch.Generator`` seeded with ``seed``.

    :param images: ``(n, C, H, W)`` in ``[0, 1]`` (others are refused: the clip would change them), ``C, H, W >= 1``
        (``n = 0`` gives an empty result).
    :param kind: ``"gaussian_noise"``, ``"rotation"`` or ``"blur"``.
    :param severity: ``1 .. 5``.
    :param seed: Seed of the local generator, in ``[0, 2**64 - 1]``.
    :return: Shifted images, same shape and dtype.
    """
    _check_images(images, "shift_images")
    if images.numel() and (images.min() < 0 or images.max() > 1):  # standardised images were clipped silently
        raise ValueError(
            f"shift_images: expected images in [0, 1] (every shift clips to it), got values in "
            f"[{images.min().item():g}, {images.max().item():g}]; shift the images before standardising them"
        )
    check_choice("kind", kind, SHIFT_KINDS, where="shift_images")  # also an unhashable kind (a list)
    severity = check_int("severity", severity, 1, 5, where="shift_images")  # Python and NumPy integers
    seed = check_seed("seed", seed, where="shift_images")
    value = SHIFT_PARAMETERS[kind][severity - 1]
    generator = torch.Generator().manual_seed(seed)
    if kind == "gaussian_noise":
        noise = torch.randn(images.shape, generator=generator, dtype=images.dtype)
        shifted = images + value * noise.to(images.device)
    elif kind == "rotation":
        signs = torch.randint(0, 2, (images.shape[0],), generator=generator).to(images.dtype) * 2 - 1
        shifted = _rotate(images, value * signs.to(images.device))  # images checked above
    else:
        shifted = _blur(images, value)
    return shifted.clamp(0, 1)


def make_shifted_test_sets(
    dataset: ImageDataset,
    seed: int = 0,
    kinds: tuple[str, ...] = SHIFT_KINDS,
    severities: tuple[int, ...] = (1, 2, 3, 4, 5),
) -> dict[tuple[str, int], ImageDataset]:
    """Shifted copies of a data set (typically the in-distribution test split), one per kind and severity.

    Labels and class names are kept. Each (kind, severity) draws from its own seed, derived from ``seed``, the kind
    and the severity by ``numpy.random.SeedSequence``, so the sets are independent and reproducible.

    :param dataset: The clean data set.
    :param seed: Base seed, in ``[0, 2**64 - 1]``.
    :param kinds: Shift kinds (default all of ``SHIFT_KINDS``).
    :param severities: Severities (default ``1 .. 5``).
    :return: ``{(kind, severity): ImageDataset}``.
    """
    if not isinstance(dataset, ImageDataset):
        raise TypeError(f"expected dataset to be an ImageDataset, got {type(dataset).__name__}")
    check_seed("seed", seed, where="make_shifted_test_sets")
    check_sequence("kinds", kinds, "('blur',)", where="make_shifted_test_sets")
    check_sequence("severities", severities, "(1, 3)", where="make_shifted_test_sets")
    kinds, severities = tuple(kinds), tuple(severities)  # iterators: the loops below read them more than once
    # checked before the seeds are derived: SeedSequence said "expected non-negative integer" for severity -1, "seed
    # must be integer" for 2.5; a list as a kind was "unhashable type: 'list'"
    for kind in kinds:
        check_choice("kinds", kind, SHIFT_KINDS, where="make_shifted_test_sets")
    for severity in severities:
        check_int("severity", severity, 1, 5, where="make_shifted_test_sets")
    shifted = {}
    for kind in kinds:
        for severity in severities:
            sub_seed = int(np.random.SeedSequence([seed, SHIFT_KINDS.index(kind), severity]).generate_state(1)[0])
            shifted[(kind, severity)] = ImageDataset(
                shift_images(dataset.images, kind, severity, sub_seed),
                dataset.labels.clone(),  # its own: an in-place edit of one set stays there
                dataset.num_classes,
                dataset.class_names,
                f"{dataset.description} | shift {kind} severity {severity} "
                f"({kind} parameter {SHIFT_PARAMETERS[kind][severity - 1]})",
            )
    return shifted


def _digit_quantiles(num_pixels: int) -> Tensor:
    """The pooled pixel-intensity quantiles of all digits at levels ``(i + 0.5) / num_pixels``."""
    images, _ = _digits_raw()
    levels = (np.arange(num_pixels) + 0.5) / num_pixels
    return torch.from_numpy(np.quantile(images.reshape(-1), levels).astype(np.float32))


def make_noise_ood(n: int, seed: int = 0, image_size: int = 8) -> ImageDataset:
    """Structured-noise OOD images with digit-like intensity statistics.

    Image ``i`` belongs to family ``i mod 3`` (labels index ``class_names``):

    * ``smooth_field``: white noise blurred with a Gaussian of sigma uniform on ``[0.7, 1.5]`` pixels;
    * ``blobs``: a sum of 1 to 3 isotropic Gaussian bumps, centres uniform on the image, widths uniform on
      ``[0.8, 2]`` pixels, weights uniform on ``[0.5, 1]``;
    * ``stripes``: a sinusoidal grating with uniform orientation, spatial period uniform on ``[2.5, 6]`` pixels and
      uniform phase.

    Each raw pattern is then *histogram matched* to the digits: its pixels, ranked, take the pooled digit pixel
    quantiles (about half of them exactly 0, mean about 0.3, maximum 1), so every noise image has the same intensity
    histogram as an average digit and differs only in spatial structure. The quantiles pool all 1,797 images of
    scikit-learn's digits, test images and every class included (against the training and validation images alone
    they differ by at most 0.0625, 0.003 on average): the OOD set carries that much of the test split's statistics.

    :param n: Number of images, at least 1.
    :param seed: Seed of the local ``torch.Generator``, in ``[0, 2**64 - 1]``.
    :param image_size: Side of the square images (8 for the digits), at least 2.
    :return: ``float32 (n, 1, image_size, image_size)`` in ``[0, 1]``, labels the family index.
    """
    n = check_int("n", n, minimum=1, where="make_noise_ood")
    image_size = check_int("image_size", image_size, minimum=2, where="make_noise_ood")
    seed = check_seed("seed", seed, where="make_noise_ood")
    generator = torch.Generator().manual_seed(seed)
    side = image_size
    labels = torch.arange(n) % len(NOISE_OOD_FAMILIES)
    coords = torch.arange(side, dtype=torch.float32)
    ys, xs = torch.meshgrid(coords, coords, indexing="ij")  # shape: (H, W) each
    raw = torch.empty(n, 1, side, side)
    for i in range(n):
        family = int(labels[i])
        if family == 0:
            sigma = 0.7 + 0.8 * float(torch.rand((), generator=generator))
            noise = torch.randn(1, 1, side, side, generator=generator)
            raw[i] = gaussian_blur(noise, sigma)[0]
        elif family == 1:
            count = int(torch.randint(1, 4, (), generator=generator))
            centres = torch.rand(count, 2, generator=generator) * (side - 1)
            widths = 0.8 + 1.2 * torch.rand(count, generator=generator)
            weights = 0.5 + 0.5 * torch.rand(count, generator=generator)
            dist2 = (ys - centres[:, 0, None, None]) ** 2 + (xs - centres[:, 1, None, None]) ** 2
            raw[i, 0] = (weights[:, None, None] * torch.exp(-0.5 * dist2 / widths[:, None, None] ** 2)).sum(0)
        else:
            angle = math.pi * float(torch.rand((), generator=generator))
            period = 2.5 + 3.5 * float(torch.rand((), generator=generator))
            phase = 2 * math.pi * float(torch.rand((), generator=generator))
            projection = xs * math.cos(angle) + ys * math.sin(angle)
            raw[i, 0] = torch.sin(2 * math.pi * projection / period + phase)
    # tiny jitter breaks exact ties so the ranking is well defined
    raw = raw + 1e-6 * torch.rand(raw.shape, generator=generator)
    quantiles = _digit_quantiles(side * side)
    ranks = raw.reshape(n, -1).argsort(dim=1).argsort(dim=1)
    images = quantiles[ranks].reshape(n, 1, side, side)
    return ImageDataset(
        images,
        labels,
        len(NOISE_OOD_FAMILIES),
        NOISE_OOD_FAMILIES,
        f"structured noise OOD (smooth fields, blobs, stripes), {side}x{side}, histogram-matched to the digits, "
        f"seed {seed}; labels index class_names",
    )
