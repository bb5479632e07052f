#!/usr/bin/env bash
# Creates the virtual environment and installs ctr-lightning with a matching
# torch / fbgemm-gpu / torchrec triple. Called by `make setup`; safe to re-run.
set -euo pipefail

VENV="${1:-.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
FBGEMM_VERSION="${FBGEMM_VERSION:-1.8.0}"
TORCHREC_VERSION="${TORCHREC_VERSION:-1.8.0}"

fail() { echo "setup: ERROR: $*" >&2; exit 1; }
step() { echo "setup: $*"; }

command -v "$PYTHON" >/dev/null || fail "no '$PYTHON' on PATH; install Python >= 3.10 or set PYTHON=..."
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
  || fail "Python >= 3.10 needed, found $("$PYTHON" --version 2>&1)"

if [ ! -x "$VENV/bin/python" ]; then
  step "creating $VENV"
  "$PYTHON" -m venv "$VENV" || fail "could not create the virtual environment $VENV (is python3-venv installed?)"
fi
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check)

# torch first: everything else must match its build (CPU or CUDA).
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(not torch.__version__.startswith('$TORCH_VERSION'))" 2>/dev/null; then
  step "installing torch==$TORCH_VERSION"
  "${PIP[@]}" "torch==$TORCH_VERSION" || fail "could not install torch==$TORCH_VERSION (set TORCH_VERSION to one your index has)"
fi
CUDA="$("$VENV/bin/python" -c 'import torch; print(torch.version.cuda or "")')"
if [ -n "$CUDA" ]; then FBGEMM_PKG="fbgemm-gpu"; else FBGEMM_PKG="fbgemm-gpu-cpu"; fi
step "torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)') (CUDA: ${CUDA:-none}) -> $FBGEMM_PKG==$FBGEMM_VERSION"

# The other fbgemm variant must not linger: both install the same fbgemm_gpu package.
OTHER="fbgemm-gpu"; [ "$FBGEMM_PKG" = "fbgemm-gpu" ] && OTHER="fbgemm-gpu-cpu"
if "$VENV/bin/python" -m pip show "$OTHER" >/dev/null 2>&1; then
  "$VENV/bin/python" -m pip uninstall -y "$OTHER" || fail "could not remove $OTHER"
fi
"${PIP[@]}" "$FBGEMM_PKG==$FBGEMM_VERSION" "torch==$TORCH_VERSION" \
  || fail "could not install $FBGEMM_PKG==$FBGEMM_VERSION to match torch $TORCH_VERSION"

# torchrec's metadata pins the CUDA fbgemm and an old torchmetrics: install it bare, then its light deps.
# pip then reports that conflict ("torchrec 1.8.0 requires fbgemm-gpu ..."); it is expected and harmless.
"${PIP[@]}" --no-deps "torchrec==$TORCHREC_VERSION" || fail "could not install torchrec==$TORCHREC_VERSION"
"${PIP[@]}" -e ".[test,bench]" "torch==$TORCH_VERSION" || fail "could not install ctr-lightning and its dependencies"

step "checking the install"
"$VENV/bin/python" - <<'PY' || fail "the installed packages do not work together (see the error above)"
import torch, fbgemm_gpu, torchrec, lightning, pyarrow, torchmetrics  # noqa: F401
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
import ctr_lightning.datamodules, ctr_lightning.models  # noqa: F401
kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 1]))
out = torch.ops.fbgemm.asynchronous_complete_cumsum(torch.tensor([1, 1]))
print(f"setup: ok: torch {torch.__version__}, torchrec {torchrec.__version__}, lightning {lightning.__version__}")
PY
