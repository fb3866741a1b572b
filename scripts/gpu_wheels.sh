#!/usr/bin/env bash
# Download, here, the wheels a GPU node lacks beside its own torch stack, for scripts/gpu_check.sh
# to install there without a network (README: "GPU node check").
#
#   scripts/gpu_wheels.sh [DIR] [--flashinfer]     # DIR defaults to .whl (git-ignored)
#
# The node's Python is 3.12 on x86-64 (manylinux). Versions are the ones installed in this
# checkout's .venv (what CI tests), else pip's newest. --no-deps: every wheel is named here.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.whl
flashinfer=0
for arg in "$@"; do
    case "$arg" in
        --flashinfer) flashinfer=1 ;;
        -*) echo "gpu_wheels.sh: error: unknown option $arg" >&2; exit 2 ;;
        *) dest="$arg" ;;
    esac
done
py=${PYTHON:-.venv/bin/python}
[ -x "$py" ] || py=python3
# the project's dependencies that the GPU image does not hold, and theirs
names=(pydantic pydantic-core annotated-types typing-inspection typing-extensions
       sqlalchemy alembic mako structlog psycopg psycopg-binary)
if [ "$flashinfer" = 1 ]; then  # the `gpu` extra without vLLM (too large to carry)
    names+=(flashinfer-python apache-tvm-ffi nvidia-cudnn-frontend)
fi
pins=$("$py" - "${names[@]}" <<'PY'
import sys
from importlib import metadata
for name in sys.argv[1:]:
    try:
        print(f"{name}=={metadata.version(name)}")
    except metadata.PackageNotFoundError:
        print(name)
PY
)
platforms=()
for n in 17 24 27 28 31 34; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
mkdir -p "$dest"
# shellcheck disable=SC2086  # one pin per word
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d "$dest" $pins
du -sh "$dest"
ls "$dest"
