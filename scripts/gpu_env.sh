# Sourced by the GPU check scripts (device machine): installs the wheels of packages the GPU image
# lacks from .whl/ (if any) into /tmp/site, sets PYTHONPATH, and writes $OUT/machine.txt.
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "gpu_env: installing the wheels of .whl/ failed" >&2; return 1 2>/dev/null || exit 1; }
    export PYTHONPATH="$PWD:/tmp/site"
else
    export PYTHONPATH="$PWD"
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc;
  python3 -c "import torch, torchvision; print('torch', torch.__version__, 'torchvision', torchvision.__version__)"; } | tee "$OUT/machine.txt"
