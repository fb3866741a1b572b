#!/usr/bin/env bash
# grpod's GPU node check (bench/gpu_check.py; README: "GPU node check"): one call on any CUDA
# machine, one JSON file and a short table, well inside 10 minutes.
#
#   bash scripts/gpu_check.sh [--out FILE] [--wheels DIR] [--budget SECONDS] [--only S ...]
#   bash scripts/gpu_check.sh --dry-run [--out FILE]     # CPU, tiny sizes (CI)
#
# It makes a venv over the node's own python (PYTHON, default python3: its torch, CUDA,
# transformers) at GRPOD_GPU_VENV (default a temporary directory), installs what the node
# lacks from the carried wheels (--wheels, default .whl; scripts/gpu_wheels.sh fetches them),
# makes this checkout importable as grpod (no build), and runs the check there.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
wheels="$root/.whl"
args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --wheels) wheels="${2:?gpu_check.sh: --wheels needs a directory}"; shift 2 ;;
        --wheels=*) wheels="${1#--wheels=}"; shift ;;
        *) args+=("$1"); shift ;;
    esac
done
py="${PYTHON:-python3}"
venv="${GRPOD_GPU_VENV:-$(mktemp -d /tmp/grpod-gpu-check.XXXXXX)}"
setup_report="$venv.setup.json"
export PYTHONUNBUFFERED=1
if ! venv_python=$("$py" bench/gpu_check.py setup --venv "$venv" --wheels "$wheels" \
        --report "$setup_report"); then
    echo "gpu_check.sh: error: setup failed: $("$py" -c 'import json,sys; print(json.load(open(sys.argv[1])).get("reason"))' "$setup_report" 2>/dev/null || echo see above)" >&2
    exit 2
fi
"$venv_python" bench/gpu_check.py run --setup-report "$setup_report" ${args[@]+"${args[@]}"}
