"""Images as non-overlapping square patches and back: the vectors ``(n, N, C p^2)`` that
:class:`~gpattn.models.Transformer` takes with ``input="vectors"`` (the same tokens as its ``"patches"`` embedding)."""

from __future__ import annotations

import numbers
from collections.abc import Iterable

from torch import Tensor

from ..validation import InputTypeError, check_int, check_tensor

__all__ = ["images_to_patches", "patches_to_images"]


def images_to_patches(images: Tensor, patch_size: int) -> Tensor:
    """Cut images into non-overlapping square patches, flattened as vectors for ``input="vectors"``.

    Patches are ordered row by row (the order of the Transformer's ``"patches"`` tokens); each vector flattens its
    patch as ``(C, p, p)``, the layout of a ``Conv2d(C, d, kernel_size=p, stride=p)`` weight, so a linear embedding of
    these vectors equals the ``"patches"`` embedding. (With ``input="patches"`` the Transformer takes the images
    ``(n, C, H, W)`` directly; this function is only needed for ``input="vectors"``.)

    :param images: ``(n, C, H, W)`` with ``patch_size`` dividing ``H`` and ``W``.
    :param patch_size: Patch side ``p``.
    :return: ``(n, (H / p) (W / p), C p^2)``.
    """
    if not isinstance(images, Tensor):
        raise InputTypeError(f"expected images to be a torch.Tensor (n, C, H, W), got {type(images).__name__}")
    if images.dim() != 4:
        raise ValueError(f"expected images (n, C, H, W), got {tuple(images.shape)}")
    n, channels, height, width = images.shape
    p = check_int("patch_size", patch_size, where="images_to_patches")  # also a NumPy integer
    if height % p or width % p:
        raise ValueError(f"patch_size {p} must divide the image size {(height, width)}")
    patches = images.reshape(n, channels, height // p, p, width // p, p).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(n, (height // p) * (width // p), channels * p * p)


def patches_to_images(patches: Tensor, image_size: int | tuple[int, int], patch_size: int, in_channels: int) -> Tensor:
    """Inverse of :func:`images_to_patches`.

    :param patches: ``(n, N, C p^2)``.
    :param image_size: ``H`` (square) or ``(H, W)``.
    :param patch_size: Patch side ``p``.
    :param in_channels: Channels ``C``.
    :return: Images ``(n, C, H, W)``.
    """
    check_tensor("patches", patches)
    size = tuple(image_size) if isinstance(image_size, Iterable) and not isinstance(image_size, (str, bytes)) else None
    if isinstance(image_size, numbers.Integral):  # also a NumPy integer (a bool is refused below)
        height = width = image_size
    elif size is not None and len(size) == 2:  # a tuple, list, torch.Size or array (H, W)
        height, width = size
    else:
        raise InputTypeError(
            f"patches_to_images: expected image_size to be a positive integer H or a pair (H, W), got {image_size!r}"
        )
    height, width = (check_int("image_size", side, where="patches_to_images") for side in (height, width))
    p = check_int("patch_size", patch_size)
    check_int("in_channels", in_channels)
    if height % p or width % p:
        raise ValueError(f"patch_size {p} must divide the image size {(height, width)}")
    expected = ((height // p) * (width // p), in_channels * p * p)
    if patches.dim() != 3 or tuple(patches.shape[1:]) != expected:
        raise ValueError(f"expected patches (n, {expected[0]}, {expected[1]}), got {tuple(patches.shape)}")
    n = patches.shape[0]
    images = patches.reshape(n, height // p, width // p, in_channels, p, p).permute(0, 3, 1, 4, 2, 5)
    return images.reshape(n, in_channels, height, width)
