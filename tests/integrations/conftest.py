"""gpattn.integrations is imported before timm and transformers: on a machine whose torchvision cannot load its
compiled operators beside the installed torch (PyPI's CUDA torchvision beside a CPU torch), it makes them importable
(gpattn/integrations/torchvision_import.py)."""

import gpattn.integrations  # noqa: F401
