"""Convert the attention blocks of timm and Hugging Face models to gpattn layers.

``gpattn.integrations.timm.convert_attention`` (extra ``gpattn[timm]``) and
``gpattn.integrations.huggingface.convert_attention`` (extra ``gpattn[huggingface]``) replace the attention modules
of chosen blocks by adapters around a registry layer; what both share is here. A converted model trains with
:class:`~gpattn.mlls.AttentionELBO` and predicts with :func:`~gpattn.models.predict_probabilities` as it is.
"""

from .conversion import (
    HEAD_TARGETS,
    LINEAR_TARGETS,
    AttentionAdapter,
    build_layer,
    convert_modules,
    copy_projections,
    padding_mask,
    resolve_blocks,
)
from .torchvision_import import import_torchvision

# before timm or transformers import it (gpattn.integrations.timm and .huggingface are submodules of this package)
import_torchvision()

__all__ = [
    "HEAD_TARGETS",
    "LINEAR_TARGETS",
    "AttentionAdapter",
    "build_layer",
    "convert_modules",
    "copy_projections",
    "import_torchvision",
    "padding_mask",
    "resolve_blocks",
]
