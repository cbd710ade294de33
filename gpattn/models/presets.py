"""Published model configurations, as keyword arguments of :class:`~gpattn.models.Transformer`.

Use ``Transformer(num_classes=10, **VIT_CIFAR_PRESET)`` (copy the dict before changing an entry:
``{**VIT_CIFAR_PRESET, "depth": 2}``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["VIT_CIFAR_PRESET"]

VIT_CIFAR_PRESET: dict[str, Any] = {
    "input": "patches",
    "image_size": 32,
    "patch_size": 4,  # 8 x 8 = 64 tokens
    "in_channels": 3,
    "embed_dim": 384,
    "depth": 7,
    "num_heads": 12,
    "mlp_ratio": 1.0,  # MLP width 384
    "dropout": 0.1,
    "attention": "kep_svgp",
    "gp_layers": 1,  # KEP-SVGP attention in the last block only
    "num_inducing": 10,
}
"""The CIFAR-10/100 ViT of KEP-SVGP (Chen, Tao, Tonin, Suykens, *Self-Attention through Kernel-Eigen Pair Sparse
Variational Gaussian Processes*, ICML 2024, arXiv 2402.01476; official code defaults): depth 7, width 384, 12 heads,
MLP width 384, 32 x 32 images in 4 x 4 patches (N = 64), dropout 0.1, mean pooling, KEP-SVGP attention with rank
s = 10 in the last layer only. The paper trains it for 300 epochs, batch 128, Adam (lr 1e-3, weight decay 5e-5,
cosine schedule to 1e-5, 5 warm-up epochs), with KL weight 1 and KSVD weight eta = 1 (``merge="sum"``) or 10
(``"concat"``), and evaluates with 10 Monte Carlo forward passes. ``num_classes`` is not part of the preset (10 or
100)."""
