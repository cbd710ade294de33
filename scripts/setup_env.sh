#!/usr/bin/env bash
# Idempotent development-environment set-up for gpattn.
#   - creates .venv (with $PYTHON, default python3) if missing
#   - installs ${GPATTN_TORCH_SPEC:-torch==2.13.0} first, only if torch is not importable
#     (a bare `torch` requirement would otherwise pull the large CUDA wheels)
#   - installs the package editable with the [test] extra, with the installed torch as a constraint (so that no
#     dependency, e.g. timm's torchvision, replaces it: pip picks the torchvision release made for it), skipped while
#     the stamp .venv/.gpattn-installed is newer than pyproject.toml
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${GPATTN_TORCH_SPEC:-torch==2.13.0}"
VENV=".venv"

# pip on this kind of machine warns about every missing local index folder; keep real errors only
quiet_pip() { "$VPY" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
VPY="$VENV/bin/python"
STAMP="$VENV/.gpattn-installed"

if [ ! -x "$VPY" ]; then
    echo "[setup_env] creating $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
else
    echo "[setup_env] $VENV exists"
fi

if TORCH_VERSION="$("$VPY" -c 'import torch; print(torch.__version__)' 2>/dev/null)"; then
    echo "[setup_env] torch $TORCH_VERSION already installed"
else
    echo "[setup_env] installing $TORCH_SPEC"
    quiet_pip install --quiet --disable-pip-version-check "$TORCH_SPEC"
fi

if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ]; then
    echo "[setup_env] gpattn up to date (stamp newer than pyproject.toml)"
else
    echo "[setup_env] installing gpattn (editable, [test] extra)"
    TORCH_VERSION="$("$VPY" -c 'import torch; print(torch.__version__)')"
    quiet_pip install --quiet --disable-pip-version-check --constraint <(echo "torch==$TORCH_VERSION") -e ".[test]"
    touch "$STAMP"
fi

echo "[setup_env] done"
