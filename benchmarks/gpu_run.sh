#!/usr/bin/env bash
# The CUDA check and GPU figures, as one prepared run on a lent GPU machine (the `device`
# tool of this workplace: no package index there, Python 3.12, CUDA 13, PyTorch's NVIDIA
# libraries installed, onnxruntime CPU only).
#
# What it needs beside the checkout, carried in an ignored `.gpu/` folder that
# `benchmarks/gpu_stage.sh` writes here (where the package index is reachable):
#   - onnxruntime-gpu's CUDA 13 wheel, too big for one call: its CUDA provider library
#     xz-compressed and split into 50 MiB parts (`.gpu/parts/`), each carried by one call
#     and copied to /tmp/parts (calls in a row, while the machine is warm), and the rest of the
#     wheel as `.gpu/rest/rest.tar.xz`;
#   - `.gpu/rest/*.whl`: trio, outcome, pytest-trio, serve's starlette, httptools and orjson,
#     and a trioinfer wheel of this checkout;
#   - `.gpu/rest/cuda.sha`: the sha256 of the whole compressed library.
# Then: `bash benchmarks/gpu_run.sh 'BENCH COMMAND' ...` with `.gpu/rest` carried: each
# argument is a benchmark command run after the tests, for instance issue 20's goal 2 on the GPU:
#   bash benchmarks/gpu_run.sh \
#     'python3 benchmarks/bench_engine.py --model wide --device cuda:0 --rows 32 --batcher dynamic
#        --max-batch 128 --configs A,c --concurrency 16 --depth 2' \
#     'python3 benchmarks/bench_engine.py --model wide --device cuda:0 --batcher dynamic
#        --configs c,f --concurrency 256' Everything it prints is also
# written under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_run.log") 2>&1
REPO=$(pwd)
SITE=/tmp/site
export PYTHONUNBUFFERED=1

echo "== assemble onnxruntime-gpu"
cat /tmp/parts/part* > /tmp/cuda.so.xz
(cd /tmp && sha256sum -c "$REPO/.gpu/rest/cuda.sha") || exit 1
rm -rf "$SITE" && mkdir -p "$SITE"
tar xJf .gpu/rest/rest.tar.xz -C "$SITE" || exit 1
python3 -c "import lzma, shutil; shutil.copyfileobj(lzma.open('/tmp/cuda.so.xz'), open('$SITE/onnxruntime/capi/libonnxruntime_providers_cuda.so', 'wb'), 1 << 24)" || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .gpu/rest/*.whl || exit 1
export PYTHONPATH=$SITE
nvidia-smi -L
python3 - <<'EOF'
import onnxruntime as ort
print("onnxruntime", ort.__version__, ort.__file__)
ort.preload_dlls()
print("providers", ort.get_available_providers())
import trioinfer, trioinfer_onnxruntime
print("trioinfer", trioinfer.__version__ if hasattr(trioinfer, "__version__") else "", trioinfer.__file__)
EOF

echo "== tests on the GPU (the ONNX Runtime backend, the engine, CUDA shared memory)"
python3 -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning \
    tests/test_onnxruntime.py tests/test_engine.py tests/test_cuda_shm.py -rs 2>&1 | tail -25

echo "== benchmarks"
for cmd in "$@"; do
    echo "\$ $cmd"
    timeout "${BENCH_TIMEOUT:-240}" bash -c "$cmd"
done
echo "== done"
