#!/usr/bin/env bash
# Idempotent development-environment set-up for gpattn.
#   - creates .venv (with $PYTHON, default python3) if missing
#   - installs ${GPATTN_TORCH_SPEC:-torch==2.13.0} first, only if torch is not installed
#     (a bare `torch` requirement would otherwise pull the large CUDA wheels)
#   - installs the package editable with the [test] extra, with the installed torch as a constraint (so that no
#     dependency, e.g. timm's torchvision, replaces it: pip picks the torchvision release made for it), skipped while
#     the stamp .venv/.gpattn-installed is newer than pyproject.toml; says so when that torchvision is PyPI's CUDA
#     build beside a CPU torch (its compiled operators, which gpattn does not use, cannot load)
# Versions are read from the installed packages' metadata: importing torch before NumPy is installed prints
# "Failed to initialize NumPy".
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${GPATTN_TORCH_SPEC:-torch==2.13.0}"
VENV=".venv"

# pip on this kind of machine warns about every missing local index folder; keep real errors only
quiet_pip() { "$VPY" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
VPY="$VENV/bin/python"
STAMP="$VENV/.gpattn-installed"
# the installed version of a distribution, without importing it; fails when it is not installed
installed_version() { "$VPY" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$1" 2>/dev/null; }

if [ ! -x "$VPY" ]; then
    echo "[setup_env] creating $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
else
    echo "[setup_env] $VENV exists"
fi

if TORCH_VERSION="$(installed_version torch)"; then
    echo "[setup_env] torch $TORCH_VERSION already installed"
else
    echo "[setup_env] installing $TORCH_SPEC"
    quiet_pip install --quiet --disable-pip-version-check "$TORCH_SPEC"
fi

if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ]; then
    echo "[setup_env] gpattn up to date (stamp newer than pyproject.toml)"
else
    echo "[setup_env] installing gpattn (editable, [test] extra)"
    TORCH_VERSION="$(installed_version torch)"
    quiet_pip install --quiet --disable-pip-version-check --constraint <(echo "torch==$TORCH_VERSION") -e ".[test]"
    VISION_VERSION="$(installed_version torchvision || true)"
    if [[ "$TORCH_VERSION" == *+cpu && -n "$VISION_VERSION" && "$VISION_VERSION" != *+cpu ]]; then
        # PyPI has no CPU torchvision: its Linux wheels link the CUDA torch (libtorch_cuda.so, libcudart)
        echo "[setup_env] note: torchvision $VISION_VERSION (timm's dependency) is PyPI's build for the CUDA torch;" \
            "beside torch $TORCH_VERSION its compiled operators (torchvision.ops.nms, roi_align, image decoding)" \
            "cannot load. gpattn uses none of them. For a matching build add" \
            "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu (docs/installation.md)"
    fi
    touch "$STAMP"
fi

echo "[setup_env] done"
