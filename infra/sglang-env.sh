#!/usr/bin/env bash
# Create (or update) the GPU node's SGLang virtualenv: SGLang at the release the project pins, plus this checkout
# installed without dependencies (SGLang's CUDA torch stays). It is a separate environment: never the project's
# .venv, whose CPU torch and Prefect must not meet SGLang's CUDA wheels (docs/pipeline.md).
# It prints (on stdout, alone) the python to put in the config's `data.sglang_python`; progress goes to stderr.
#
#   infra/sglang-env.sh [DEST] [--no-gpu-check]      (DEST defaults to /opt/sglang)
#
# PYTHON picks the interpreter the environment is made from (default python3; SGLang needs 3.10+).
# --no-gpu-check builds it where no GPU is visible (an image build); SGLang itself only runs on CUDA.
set -euo pipefail

SGLANG_VERSION=0.5.23   # = SUPPORTED_RELEASES in eagle3/runtime/sglang_features.py (checked below)

usage() {
  echo "usage: infra/sglang-env.sh [DEST] [--no-gpu-check]   (DEST default: /opt/sglang; env PYTHON=python3.X)" >&2
  exit 2
}
die() { echo "infra/sglang-env.sh: $*" >&2; exit 1; }
log() { echo "$@" >&2; }

DEST=/opt/sglang
GPU_CHECK=1
positional=0
for arg in "$@"; do
  case $arg in
    --no-gpu-check) GPU_CHECK=0 ;;
    -h|--help) usage ;;
    -*) echo "infra/sglang-env.sh: unknown option '$arg'" >&2; usage ;;
    *) [[ $positional -eq 0 ]] || usage; DEST=$arg; positional=1 ;;
  esac
done

CHECKOUT=$(cd "$(dirname "$0")/.." && pwd -P)
PYTHON=${PYTHON:-python3}
command -v "$PYTHON" > /dev/null || die "no '$PYTHON' on PATH (set PYTHON to a Python 3.10+ interpreter)"
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || die "$PYTHON is older than 3.10; SGLang needs 3.10+"

# The pin is the project's: capture refuses any other release.
pin=$(sed -n 's/^SUPPORTED_RELEASES = engines\.ReleaseRange("\([0-9.]*\)", "\([0-9.]*\)").*/\1 \2/p' \
  "$CHECKOUT/eagle3/runtime/sglang_features.py")
if [[ -z $pin ]]; then
  log "warning: could not read SUPPORTED_RELEASES from eagle3/runtime/sglang_features.py; installing $SGLANG_VERSION"
elif [[ $pin != "$SGLANG_VERSION $SGLANG_VERSION" ]]; then
  die "this script pins SGLang $SGLANG_VERSION but eagle3/runtime/sglang_features.py supports '${pin/ /–}': update SGLANG_VERSION"
fi

# Never the project's environment.
dest_abs=$(realpath -m "$DEST")
for project_venv in "$CHECKOUT/.venv" "${EAGLE3_VENV:-}"; do
  [[ -n $project_venv && -d $project_venv ]] || continue
  [[ $dest_abs != "$(realpath -m "$project_venv")" ]] || die "$DEST is the project's virtualenv; SGLang gets its own (e.g. /opt/sglang)"
done
if [[ -x $DEST/bin/python ]] && "$DEST/bin/python" -c 'import prefect' 2> /dev/null; then
  die "$DEST/bin/python has Prefect: that looks like the project's environment; SGLang gets its own (e.g. /opt/sglang)"
fi
[[ -z ${VIRTUAL_ENV:-} || $(realpath -m "$VIRTUAL_ENV") != "$dest_abs" ]] || die "deactivate $VIRTUAL_ENV first"

if [[ $GPU_CHECK -eq 1 ]]; then
  command -v nvidia-smi > /dev/null && nvidia-smi -L > /dev/null 2>&1 \
    || die "no NVIDIA GPU visible (nvidia-smi): SGLang is CUDA-only; run this on the GPU node (or pass --no-gpu-check)"
fi

[[ -e $DEST/pyvenv.cfg ]] || { log "Creating the virtualenv $DEST ($("$PYTHON" --version))"; "$PYTHON" -m venv "$DEST"; }
PY=$DEST/bin/python
# Installs go into DEST's own site-packages only: its python must be a virtualenv whose prefix is DEST (a python
# that merely sits in DEST/bin, e.g. a link to another interpreter, would install into that one).
"$PY" - "$dest_abs" <<'EOF_PY' || die "$PY is not the python of a virtualenv at $DEST; remove $DEST or pick another DEST"
import os, sys
sys.exit(not (sys.prefix != sys.base_prefix and os.path.realpath(sys.prefix) == sys.argv[1]))
EOF_PY
installed=$("$PY" -c 'import importlib.metadata as m; print(m.version("sglang"))' 2> /dev/null || true)
if [[ $installed == "$SGLANG_VERSION" ]]; then
  log "SGLang $SGLANG_VERSION already in $DEST"
else
  log "Installing SGLang $SGLANG_VERSION into $DEST${installed:+ (replacing $installed)}: its CUDA torch, flashinfer, sgl-kernel…"
  "$PY" -m pip install --quiet --upgrade pip >&2
  "$PY" -m pip install "sglang==$SGLANG_VERSION" >&2
fi
# The project itself, without dependencies: SGLang's environment already has what capture imports, and the CPU
# torch the project would otherwise pull must not replace SGLang's CUDA one.
"$PY" -m pip install --quiet --no-deps -e "$CHECKOUT" >&2

"$PY" - "$SGLANG_VERSION" >&2 <<'EOF'
import importlib.metadata as metadata
import sys

import torch

import eagle3.data.node_capture  # noqa: F401  (the capture stage's entry here)
import eagle3.runtime.sglang_features  # noqa: F401  (the feature backend it builds)

version = metadata.version("sglang")
if version != sys.argv[1]:
    sys.exit(f"sglang {version} installed, {sys.argv[1]} expected")
cuda = torch.cuda.is_available()
print(f"sglang {version}, torch {torch.__version__} (CUDA {torch.version.cuda}, "
      f"{torch.cuda.device_count() if cuda else 0} GPUs visible)")
EOF

log "Put this in the config:  data: {sglang_python: $PY}"
echo "$PY"
