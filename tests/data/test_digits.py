"""The 8x8 digits splits, the held-out OOD classes, the CIFAR-10-C-style shifts, the noise OOD images and patches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpattn.data import (
    SHIFT_KINDS,
    ImageDataset,
    images_to_patches,
    load_digits_splits,
    make_noise_ood,
    make_shifted_test_sets,
    patches_to_images,
    shift_images,
)
from gpattn.data.digits import gaussian_blur, rotate_images
from gpattn.models import Transformer


@pytest.fixture(scope="module")
def splits():
    return load_digits_splits(seed=0)


@pytest.fixture(scope="module")
def full_splits():
    return load_digits_splits(seed=0, held_out_classes=None)


def _datasets(s):
    return [s.train, s.val, s.test]


def test_shapes_types_and_range(splits):
    for d in [*_datasets(splits), splits.ood_classes]:
        assert isinstance(d, ImageDataset)
        assert d.images.dtype == torch.float32 and d.images.shape[1:] == (1, 8, 8)
        assert d.labels.dtype == torch.int64 and d.labels.shape == (len(d),)
        assert d.images.min() >= 0 and d.images.max() <= 1 and d.images.max() == 1
        assert d.num_classes == len(d.class_names) and d.in_channels == 1 and d.image_size == (8, 8)
    # every image is used exactly once
    assert sum(len(d) for d in [*_datasets(splits), splits.ood_classes]) == 1797


def test_default_holds_out_eight_and_nine(splits):
    assert splits.held_out_classes == (8, 9)
    assert splits.label_map == {c: c for c in range(8)}
    for d in _datasets(splits):
        assert d.num_classes == 8 and d.class_names == tuple("01234567")
        assert set(d.labels.tolist()) == set(range(8))
    ood = splits.ood_classes
    assert ood.class_names == ("8", "9") and set(ood.labels.tolist()) == {0, 1}
    assert len(ood) == 174 + 180  # all 8s and 9s of the data set


def test_held_out_classes_are_absent_and_labels_reindexed():
    from sklearn.datasets import load_digits

    raw = load_digits()
    raw_images = torch.from_numpy(raw.images / 16.0).float()
    s = load_digits_splits(seed=1, held_out_classes=(3, 0))
    assert s.label_map == {1: 0, 2: 1, 4: 2, 5: 3, 6: 4, 7: 5, 8: 6, 9: 7}
    inverse = {v: k for k, v in s.label_map.items()}
    # find every image in the raw data set and check its original digit
    flat_raw = raw_images.reshape(len(raw_images), -1)

    def original_digits(d):
        match = (d.images.reshape(len(d), 1, -1) == flat_raw[None]).all(-1)  # (n, 1797)
        assert match.any(1).all()
        return [set(raw.target[row.nonzero().flatten().numpy()].tolist()) for row in match]

    for d in _datasets(s):
        assert d.class_names == ("1", "2", "4", "5", "6", "7", "8", "9")
        for label, digits in zip(d.labels.tolist(), original_digits(d), strict=True):
            assert inverse[label] in digits and not digits & {0, 3}
    assert s.ood_classes.class_names == ("3", "0")
    for label, digits in zip(s.ood_classes.labels.tolist(), original_digits(s.ood_classes), strict=True):
        assert (3, 0)[label] in digits


def test_no_held_out_classes(full_splits):
    assert full_splits.ood_classes is None and full_splits.held_out_classes == ()
    assert all(d.num_classes == 10 for d in _datasets(full_splits))
    assert sum(len(d) for d in _datasets(full_splits)) == 1797
    assert load_digits_splits(held_out_classes=()).ood_classes is None


def test_stratified(full_splits):
    counts = np.bincount(np.concatenate([d.labels.numpy() for d in _datasets(full_splits)]), minlength=10)
    for d, fraction in zip(_datasets(full_splits), (0.6, 0.15, 0.25), strict=True):
        per_class = np.bincount(d.labels.numpy(), minlength=10)
        assert np.all(np.abs(per_class - fraction * counts) <= 1)


def test_deterministic_without_the_global_rng():
    torch.manual_seed(0)
    np.random.seed(0)
    torch_state, np_state = torch.get_rng_state(), np.random.get_state()
    a, b, c = load_digits_splits(seed=3), load_digits_splits(seed=3), load_digits_splits(seed=4)
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert np.array_equal(np.random.get_state()[1], np_state[1])
    for x, y, z in zip(_datasets(a), _datasets(b), _datasets(c), strict=True):
        assert torch.equal(x.images, y.images) and torch.equal(x.labels, y.labels)
        assert not torch.equal(x.labels, z.labels)
    # the validation split is disjoint from the test split
    flat = {tuple(img.flatten().tolist()) for img in a.test.images}
    overlap = sum(tuple(img.flatten().tolist()) in flat for img in a.val.images)
    assert overlap == 0  # (scikit-learn's digits hold no two identical images, so a shared image is a shared row)


def test_val_seed_draws_the_validation_split_and_leaves_the_test_split(splits):
    drawn = {seed: load_digits_splits(seed=0, val_seed=seed) for seed in (0, 1)}
    for other in drawn.values():  # the test split of seed 0, image for image and in order
        assert torch.equal(other.test.images, splits.test.images) and torch.equal(other.test.labels, splits.test.labels)
        assert other.test.description == splits.test.description
        # the same images between training and validation, as many of each class in validation
        pool = torch.cat([other.train.images, other.val.images]).flatten(1)
        expected = torch.cat([splits.train.images, splits.val.images]).flatten(1)
        assert torch.equal(pool[_order(pool)], expected[_order(expected)])
        assert torch.equal(other.val.labels.bincount(minlength=8), splits.val.labels.bincount(minlength=8))
    assert not torch.equal(drawn[0].val.images, drawn[1].val.images)
    assert not torch.equal(drawn[0].val.images, splits.val.images)  # val_seed=None: the permutation of seed
    again = load_digits_splits(seed=0, val_seed=1)
    assert torch.equal(again.val.images, drawn[1].val.images) and "validation seed 1" in again.val.description
    with pytest.raises(ValueError, match="val_seed"):
        load_digits_splits(seed=0, val_seed=-1)


def _order(rows: torch.Tensor) -> torch.Tensor:
    """Indices that sort the rows of ``rows`` lexicographically."""
    keys = [tuple(row.tolist()) for row in rows]
    return torch.tensor(sorted(range(len(keys)), key=keys.__getitem__))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"val_fraction": 0.6, "test_fraction": 0.4},
        {"test_fraction": -0.1},
        {"held_out_classes": (10,)},
        {"held_out_classes": (1, 1)},
        {"held_out_classes": tuple(range(9))},
        {"seed": -1},
    ],
)
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        load_digits_splits(**kwargs)


@pytest.mark.parametrize("kind", SHIFT_KINDS)
def test_shift_severity_is_monotone(splits, kind):
    clean = splits.test.images
    distances = []
    for severity in range(1, 6):
        shifted = shift_images(clean, kind, severity, seed=0)
        assert shifted.shape == clean.shape and shifted.dtype == clean.dtype
        assert shifted.min() >= 0 and shifted.max() <= 1
        assert torch.equal(shifted, shift_images(clean, kind, severity, seed=0))
        distances.append((shifted - clean).abs().mean().item())
    assert distances[0] > 0.01
    assert all(a < b for a, b in zip(distances, distances[1:], strict=False)), distances


def test_noise_seeds(splits):
    clean = splits.test.images[:50]
    a = shift_images(clean, "gaussian_noise", 3, seed=0)
    assert torch.equal(a, shift_images(clean, "gaussian_noise", 3, seed=0))
    assert not torch.equal(a, shift_images(clean, "gaussian_noise", 3, seed=1))
    # blur is deterministic regardless of the seed
    assert torch.equal(shift_images(clean, "blur", 2, seed=0), shift_images(clean, "blur", 2, seed=5))


def test_rotation_by_zero_is_identity_and_by_ninety_is_rot90():
    images = torch.rand(4, 2, 6, 6, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(rotate_images(images, 0.0), images, atol=1e-6, rtol=0)
    torch.testing.assert_close(rotate_images(images, 360.0), images, atol=1e-5, rtol=0)
    # counter-clockwise as displayed (row 0 at the top)
    torch.testing.assert_close(rotate_images(images, 90.0), torch.rot90(images, 1, dims=(2, 3)), atol=1e-5, rtol=0)
    per_image = rotate_images(images, torch.tensor([0.0, 90.0, 0.0, 90.0]))
    torch.testing.assert_close(per_image[0], images[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(per_image[1], torch.rot90(images[1], 1, dims=(1, 2)), atol=1e-5, rtol=0)


def test_blur_preserves_mean_and_smooths(splits):
    clean = splits.test.images
    constant = torch.full((2, 1, 8, 8), 0.4)
    torch.testing.assert_close(gaussian_blur(constant, 1.0), constant)
    assert torch.equal(gaussian_blur(clean, 0.0), clean)
    for severity in range(1, 6):
        blurred = shift_images(clean, "blur", severity)
        assert abs(blurred.mean().item() - clean.mean().item()) < 0.02
        assert blurred.std() < clean.std()


def test_make_shifted_test_sets(splits):
    sets = make_shifted_test_sets(splits.test, seed=0)
    assert set(sets) == {(kind, severity) for kind in SHIFT_KINDS for severity in range(1, 6)}
    for d in sets.values():
        assert torch.equal(d.labels, splits.test.labels) and d.class_names == splits.test.class_names
        assert d.images.shape == splits.test.images.shape
        assert d.labels.data_ptr() != splits.test.labels.data_ptr()  # its own labels: an in-place edit stays there
    again = make_shifted_test_sets(splits.test, seed=0, kinds=("gaussian_noise",), severities=(2,))
    assert torch.equal(again[("gaussian_noise", 2)].images, sets[("gaussian_noise", 2)].images)
    # different severities use different noise draws
    n1 = sets[("gaussian_noise", 1)].images - splits.test.images
    n2 = sets[("gaussian_noise", 2)].images - splits.test.images
    assert not torch.allclose(n1 * 2, n2, atol=1e-3)


@pytest.mark.parametrize("bad", [{"kind": "fog"}, {"severity": 0}, {"severity": 6}])
def test_shift_bad_arguments(splits, bad):
    with pytest.raises(ValueError):
        shift_images(splits.test.images, **{"kind": "blur", "severity": 1, **bad})


def test_numpy_integer_severities_are_severities(splits):
    # as in MNIST-1D's shifts (they were refused as "not an integer")
    images = splits.test.images[:4]
    assert torch.equal(shift_images(images, "blur", np.int64(3)), shift_images(images, "blur", 3))
    sets = make_shifted_test_sets(splits.test, seed=0, kinds=("blur",), severities=tuple(np.arange(1, 3)))
    assert sorted(severity for _, severity in sets) == [1, 2]


def test_fractions_that_leave_a_class_without_training_images_are_refused():
    # rounding per class took every training image of seven digits, with num_classes still 8
    with pytest.raises(ValueError, match=r"leave no training image of the digit\(s\) \[1, 2, 3, 4, 5, 6, 7\]"):
        load_digits_splits(val_fraction=0.7499, test_fraction=0.25, held_out_classes=(8, 9))


def test_noise_ood(splits):
    ood = make_noise_ood(90, seed=0)
    assert ood.images.shape == (90, 1, 8, 8) and ood.images.dtype == torch.float32
    assert ood.images.min() >= 0 and ood.images.max() <= 1
    assert ood.class_names == ("smooth_field", "blobs", "stripes")
    assert torch.bincount(ood.labels).tolist() == [30, 30, 30]
    assert torch.equal(ood.images, make_noise_ood(90, seed=0).images)
    assert not torch.equal(ood.images, make_noise_ood(90, seed=1).images)
    # digit-like intensity statistics
    assert abs(ood.images.mean().item() - splits.train.images.mean().item()) < 0.03
    zeros_ood, zeros_digits = (ood.images == 0).float().mean(), (splits.train.images == 0).float().mean()
    assert abs(zeros_ood - zeros_digits) < 0.05
    # spatial structure differs from the digits: not simply a copy of any of them
    assert not (ood.images[:, None] == splits.train.images[None]).flatten(2).all(-1).any()


@pytest.mark.parametrize(
    ("arguments", "error", "match"),
    [
        ({"n": 0}, ValueError, r"make_noise_ood: expected n to be a positive integer, got 0"),
        ({"n": -1}, ValueError, r"make_noise_ood: expected n to be a positive integer, got -1"),
        ({"n": 2.0}, TypeError, r"make_noise_ood: expected n to be a positive integer, got 2\.0"),
        ({"n": 3, "image_size": 1}, ValueError, r"make_noise_ood: expected image_size to be an integer >= 2, got 1"),
    ],
    ids=["zero", "negative", "float", "image_size"],
)
def test_noise_ood_needs_at_least_one_image(arguments, error, match):
    with pytest.raises(error, match=match):
        make_noise_ood(**arguments)
    assert len(make_noise_ood(1)) == 1


MAX_SEED = 2**64 - 1  # the largest seed torch.Generator.manual_seed takes


@pytest.mark.parametrize(
    ("make", "where"),
    [
        (lambda seed: make_noise_ood(3, seed=seed), "make_noise_ood"),
        (lambda seed: shift_images(torch.full((2, 1, 8, 8), 0.5), "rotation", 1, seed=seed), "shift_images"),
        (lambda seed: shift_images(torch.full((2, 1, 8, 8), 0.5), "gaussian_noise", 1, seed=seed), "shift_images"),
        (lambda seed: load_digits_splits(seed=seed), "load_digits_splits"),
        (lambda seed: load_digits_splits(seed=0, val_seed=seed), "load_digits_splits"),
    ],
    ids=["noise_ood", "rotation", "gaussian_noise", "splits", "val_seed"],
)
def test_seeds_up_to_the_largest_torch_generator_seed(make, where):
    # 2**64 reached torch.Generator.manual_seed ("Overflow when unpacking long long"); NumPy's generators (splits,
    # val_seed) take it, but every seed of the package has one range
    with pytest.raises(
        ValueError, match=rf"{where}: expected (val_)?seed to be a non-negative integer at most 2\*\*64 - 1"
    ):
        make(2**64)
    with pytest.raises(ValueError, match=rf"{where}: expected (val_)?seed to be a non-negative integer, got -1"):
        make(-1)
    make(MAX_SEED)  # the largest accepted seed works
    make(np.int64(7))  # NumPy integers too (manual_seed itself refuses them)


def test_shifted_test_sets_take_the_largest_seed():
    dataset = ImageDataset(torch.full((2, 1, 8, 8), 0.5), torch.zeros(2, dtype=torch.long), 1, ("0",), "two")
    with pytest.raises(ValueError, match=r"make_shifted_test_sets: expected seed .* at most 2\*\*64 - 1"):
        make_shifted_test_sets(dataset, seed=2**64, severities=(1,))
    sets = make_shifted_test_sets(dataset, seed=MAX_SEED, severities=(1,))
    assert all(shifted.images.shape == (2, 1, 8, 8) for shifted in sets.values())


@pytest.mark.parametrize("kind", SHIFT_KINDS)
def test_shifts_of_an_empty_batch_are_empty(kind):
    # rotation used to fail in affine_grid: "Expected non-zero, positive output size"
    empty = torch.empty(0, 1, 8, 8)
    assert shift_images(empty, kind, 3).shape == (0, 1, 8, 8)
    assert rotate_images(empty, 30.0).shape == (0, 1, 8, 8)
    dataset = ImageDataset(empty, torch.empty(0, dtype=torch.long), 1, ("0",), "no image")
    assert all(
        len(shifted) == 0 for shifted in make_shifted_test_sets(dataset, kinds=(kind,), severities=(1,)).values()
    )


@pytest.mark.parametrize("shape", [(2, 0, 8, 8), (2, 1, 0, 8), (2, 1, 8, 0)])
@pytest.mark.parametrize(
    ("transform", "where"),
    [
        (lambda images: rotate_images(images, 30.0), "rotate_images"),
        (lambda images: gaussian_blur(images, 1.0), "gaussian_blur"),
        (lambda images: shift_images(images, "rotation", 2), "shift_images"),
        (lambda images: shift_images(images, "blur", 2), "shift_images"),
    ],
    ids=["rotate_images", "gaussian_blur", "shift_rotation", "shift_blur"],
)
def test_images_without_pixels_are_refused(shape, transform, where):
    # used to fail in affine_grid / conv2d with torch's messages
    with pytest.raises(
        ValueError, match=rf"{where}: expected images \(n, C, H, W\) with C, H and W at least 1, got shape"
    ):
        transform(torch.empty(shape))


@pytest.mark.parametrize("patch_size", [1, 2, 4, 8])
def test_patches_round_trip(splits, patch_size):
    images = splits.val.images
    patches = images_to_patches(images, patch_size)
    assert patches.shape == (len(images), (8 // patch_size) ** 2, patch_size**2)
    assert torch.equal(patches_to_images(patches, 8, patch_size, 1), images)


def test_patches_layout_matches_the_patch_embedding():
    images = torch.rand(3, 3, 8, 12, generator=torch.Generator().manual_seed(0))
    patches = images_to_patches(images, 4)
    assert patches.shape == (3, 6, 48)
    torch.testing.assert_close(patches[1, 4].reshape(3, 4, 4), images[1, :, 4:8, 4:8], rtol=0, atol=0)
    conv = torch.nn.Conv2d(3, 5, kernel_size=4, stride=4)
    expected = conv(images).flatten(2).transpose(1, 2)  # (n, N, 5), patches row by row
    torch.testing.assert_close(patches @ conv.weight.reshape(5, -1).T + conv.bias, expected)
    assert torch.equal(patches_to_images(patches, (8, 12), 4, 3), images)
    with pytest.raises(ValueError):
        images_to_patches(images, 3)


def test_transformer_takes_digits_both_ways(splits):
    images = splits.train.images[:4]
    by_patches = Transformer(
        input="patches",
        image_size=8,
        patch_size=2,
        in_channels=1,
        num_classes=8,
        embed_dim=16,
        depth=1,
        num_heads=2,
        attention="softmax",
    )
    assert by_patches(images).shape[-1] == 8
    by_vectors = Transformer(
        input="vectors", input_dim=4, max_len=16, num_classes=8, embed_dim=16, depth=1, num_heads=2, attention="softmax"
    )
    assert by_vectors(images_to_patches(images, 2)).shape[-1] == 8


def test_held_out_classes_that_are_not_a_sequence_are_named():
    # an int raised "TypeError: 'int' object is not iterable"; a tensor of digits was refused as "not digits in 0..9"
    with pytest.raises(TypeError, match=r"expected held_out_classes to be a sequence of digits .* got 8$"):
        load_digits_splits(held_out_classes=8)
    from sklearn.datasets import load_digits

    targets = load_digits().target
    from_tensor = load_digits_splits(seed=3, held_out_classes=torch.tensor([9, 2]))
    from_tuple = load_digits_splits(seed=3, held_out_classes=(9, 2))
    assert from_tensor.held_out_classes == (9, 2) and from_tensor.ood_classes.class_names == ("9", "2")
    assert torch.equal(from_tensor.train.images, from_tuple.train.images)
    assert from_tensor.ood_classes.labels.bincount().tolist() == [(targets == 9).sum(), (targets == 2).sum()]


def test_shift_arguments_of_the_wrong_kind_are_named(splits):
    images = splits.test.images[:4]
    with pytest.raises(ValueError, match=r"shift_images: expected kind to be one of .*got \['blur'\]"):
        shift_images(images, ["blur"], 1)  # was "TypeError: unhashable type: 'list'"
    with pytest.raises(TypeError, match=r"expected kinds to be a sequence, e.g. \('blur',\), got 'blur'"):
        make_shifted_test_sets(splits.test, kinds="blur")  # was "expected kinds from (...), got 'b'"
    with pytest.raises(TypeError, match=r"expected severities to be a sequence, e.g. \(1, 3\), got 3"):
        make_shifted_test_sets(splits.test, severities=3)  # was "TypeError: 'int' object is not iterable"


def test_blur_and_rotation_parameters_are_checked_and_blur_matches_scipy(splits):
    from scipy.ndimage import gaussian_filter

    images = splits.test.images[:4].double()
    with pytest.raises(ValueError, match=r"gaussian_blur: expected sigma to be a finite number >= 0, got inf"):
        gaussian_blur(images, float("inf"))  # was OverflowError: cannot convert float infinity to integer
    with pytest.raises(TypeError, match=r"gaussian_blur: expected sigma .* got '1'"):
        gaussian_blur(images, "1")
    with pytest.raises(ValueError, match=r"rotate_images: expected degrees to be a finite number, got nan"):
        rotate_images(images, float("nan"))  # returned NaN images
    with pytest.raises(ValueError, match=r"rotate_images: expected degrees of shape \(4\), got \(3,\)"):
        rotate_images(images, torch.zeros(3))  # was a RuntimeError of expand
    with pytest.raises(ValueError, match="rotate_images: degrees contains NaN"):
        rotate_images(images, torch.tensor([0.0, 10.0, float("nan"), 0.0]))
    # what is accepted: one angle (also a 0-d tensor) or one per image, equal to per-image rotations
    angles = torch.tensor([10, -20, 30, 45])
    assert torch.equal(rotate_images(images, torch.tensor(30.0)), rotate_images(images, 30.0))
    each = torch.cat([rotate_images(images[i : i + 1], float(angles[i])) for i in range(4)])
    torch.testing.assert_close(rotate_images(images, angles), each, rtol=0, atol=1e-12)
    # sigma 0.5: radius ceil(1.5) = 2, scipy's int(3 * 0.5 + 0.5) = 2, 'nearest' is replicate padding
    reference = np.stack([gaussian_filter(image[0].numpy(), 0.5, mode="nearest", truncate=3.0) for image in images])
    np.testing.assert_allclose(gaussian_blur(images, np.float64(0.5))[:, 0].numpy(), reference, rtol=0, atol=1e-12)


def test_patches_take_numpy_integers_and_match_unfold():
    images = torch.rand(3, 2, 8, 12, generator=torch.Generator().manual_seed(0))
    patches = images_to_patches(images, np.int64(4))  # was refused: "expected a positive integer patch_size"
    reference = torch.nn.functional.unfold(images, kernel_size=4, stride=4).transpose(1, 2)  # (n, N, C p^2)
    assert torch.equal(patches, reference)
    assert torch.equal(patches_to_images(patches, (np.int64(8), 12), np.int64(4), np.int64(2)), images)
    square = torch.rand(2, 1, 8, 8)
    assert torch.equal(patches_to_images(images_to_patches(square, 2), np.int64(8), 2, 1), square)  # was TypeError
    for image_size in [(8,), "8", 8.0]:  # were "not enough values to unpack" or "'float' object is not iterable"
        with pytest.raises(TypeError, match=r"patches_to_images: expected image_size to be a positive integer H or a"):
            patches_to_images(patches, image_size, 4, 2)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        # each was an error of numpy.random.SeedSequence or of a dict lookup, which named no argument
        ({"severities": (-1,)}, ValueError, r"make_shifted_test_sets: expected severity to be an integer in \[1, 5\]"),
        ({"severities": (2.5,)}, TypeError, r"make_shifted_test_sets: expected severity .* got 2.5"),
        ({"kinds": (["blur"],)}, ValueError, r"make_shifted_test_sets: expected kinds to be one of .* got \['blur'\]"),
    ],
)
def test_shifted_test_sets_name_a_bad_kind_or_severity(splits, kwargs, error, match):
    with pytest.raises(error, match=match):
        make_shifted_test_sets(splits.test, **kwargs)


def test_numpy_float_fractions_are_fractions(splits):
    # np.float32(0.25) was refused as "expected test_fraction in [0, 1), got np.float32(0.25)"
    same = load_digits_splits(val_fraction=np.float64(0.15), test_fraction=np.float32(0.25))
    assert torch.equal(same.test.images, splits.test.images) and torch.equal(same.train.labels, splits.train.labels)
    with pytest.raises(
        TypeError, match=r"load_digits_splits: expected val_fraction to be a finite number .* got '0.1'"
    ):
        load_digits_splits(val_fraction="0.1")


def test_shifts_refuse_images_outside_the_unit_range(splits):
    # standardised images were clipped to [0, 1] silently: the blur of (images - 0.5) / 0.5 lost every negative value
    images = splits.test.images[:4]
    standardised = (images - 0.5) / 0.5
    with pytest.raises(ValueError, match=r"shift_images: expected images in \[0, 1\] .* got values in \[-1, 1\]"):
        shift_images(standardised, "blur", 1)
    with pytest.raises(ValueError, match=r"expected images in \[0, 1\]"):
        brighter = ImageDataset(images * 1.5, splits.test.labels[:4], 8, splits.test.class_names, "too bright")
        make_shifted_test_sets(brighter, kinds=("rotation",), severities=(1,))
    assert shift_images(images, "blur", 1).shape == images.shape and len(shift_images(images[:0], "blur", 1)) == 0


def test_shifted_test_sets_take_iterators(splits):
    # a generator of severities was read up by the first kind: the other kinds got no shifted set, silently
    test = ImageDataset(splits.test.images[:4], splits.test.labels[:4], 8, splits.test.class_names, "four images")
    sets = make_shifted_test_sets(test, kinds=iter(("blur", "rotation")), severities=(s for s in (1, 2)))
    assert sorted(sets) == [("blur", 1), ("blur", 2), ("rotation", 1), ("rotation", 2)]
    assert torch.equal(sets[("rotation", 2)].images, make_shifted_test_sets(test)[("rotation", 2)].images)
