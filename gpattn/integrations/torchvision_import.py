"""Import torchvision (which timm and transformers import) where its compiled operators cannot be loaded."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys

import torch

logger = logging.getLogger(__name__)

#: The operators for which torchvision registers fake (meta) kernels at import time, without first checking that its
#: compiled extension, which defines them, was loaded.
FAKE_KERNEL_OPERATORS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_LIBRARIES: list[torch.library.Library] = []  # the declarations live as long as their Library object


def import_torchvision() -> None:
    """Import torchvision, if installed, so that timm and transformers can import it afterwards.

    A torchvision wheel whose compiled extension does not load beside the installed torch (PyPI's torchvision is
    built against the CUDA torch; beside a CPU torch its ``_C`` library misses ``libtorch_cuda.so``) fails to import
    with ``RuntimeError: operator torchvision::nms does not exist``: it registers fake kernels for two operators of
    that extension unconditionally. timm's and transformers' encoders, and everything gpattn.integrations does with
    them, use no torchvision operator (timm imports only torchvision's transforms and the Python module
    ``torchvision.ops.misc``), so the two schemas are declared without any kernel and the import is retried. No
    warning is issued, as nothing gpattn does is affected: the repair is logged at level INFO (logger
    ``gpattn.integrations.torchvision_import``), and whoever calls a compiled operator (``torchvision.ops.nms``,
    ``roi_align``, ``torchvision.io``'s decoders) still gets torchvision's own error ("Couldn't load custom C++
    ops"). Nothing is done when torchvision is not installed, already imported, or imports as it is.
    """
    if "torchvision" in sys.modules or importlib.util.find_spec("torchvision") is None:
        return
    try:
        importlib.import_module("torchvision")
        return
    except RuntimeError as error:
        if "torchvision::" not in str(error):
            raise
        reason = str(error)
    for name in [name for name in sys.modules if name == "torchvision" or name.startswith("torchvision.")]:
        del sys.modules[name]  # the modules of the failed import
    library = torch.library.Library("torchvision", "FRAGMENT")
    for schema in FAKE_KERNEL_OPERATORS:
        library.define(schema)
    _LIBRARIES.append(library)
    importlib.import_module("torchvision")
    logger.info(
        "torchvision %s cannot load its compiled operators beside torch %s (%s); gpattn.integrations declared the "
        "schemas it needs to import, and its operators (nms, roi_align, ...) are unavailable, which nothing in gpattn "
        "uses. Install the torchvision built for this torch to use them.",
        sys.modules["torchvision"].__version__,
        torch.__version__,
        reason,
    )
