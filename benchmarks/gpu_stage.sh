#!/usr/bin/env bash
# Stage what benchmarks/gpu_run.sh needs on a lent GPU machine, here, where the package index
# is reachable: the lent machine reaches none, and each `run` call carries at most 64 MiB.
#
# Writes the folder `.gpu/` (in .gitignore):
#   .gpu/parts/partNN  onnxruntime-gpu's CUDA provider library, xz-compressed, in 50 MiB parts
#                      (PART_MIB; a call carries the part and the checkout, 64 MiB in all):
#                      one `run` call each, while the machine stays warm, copying it to
#                      /tmp/parts (carry [".gpu/parts/partNN"], command
#                      `mkdir -p /tmp/parts && cp .gpu/parts/partNN /tmp/parts/`);
#   .gpu/rest/         the rest of the wheel (rest.tar.xz), the sha256 of the compressed
#                      library (cuda.sha), the wheels the machine's image lacks (trio, outcome,
#                      pytest-trio, and serve's starlette, httptools, orjson) and a trioinfer
#                      wheel of this checkout, built last so that
#                      re-running the script with STAGE_ONLY_TRIOINFER=1 refreshes only it.
# Then one last call carries [".gpu/rest"] and runs `bash benchmarks/gpu_run.sh 'BENCH' ...`.
#
# ORT_GPU names the wheel to fetch (default: the newest onnxruntime-gpu for CPython 3.12 on
# manylinux x86_64); the machine's image has CUDA 13 and cuDNN for CUDA 13 (see the device
# tool's KINDS.md), so pick a build for CUDA 13.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
G=$ROOT/.gpu
PY=${PYTHON:-$ROOT/.venv/bin/python}
mkdir -p "$G/rest" "$G/parts" "$G/dl"
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
fetch() {
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${PLATFORMS[@]}" -d "$1" "${@:2}"
}

if [ "${STAGE_ONLY_TRIOINFER:-0}" != 1 ]; then
    echo "== fetch ${ORT_GPU:-onnxruntime-gpu}"
    fetch "$G/dl" "${ORT_GPU:-onnxruntime-gpu}"
    wheel=$(ls "$G"/dl/onnxruntime_gpu-*.whl | tail -1)
    echo "   $(basename "$wheel"), $(du -m "$wheel" | cut -f1) MB"
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    "$PY" -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" \
        "$wheel" "$work/site"
    lib=$work/site/onnxruntime/capi/libonnxruntime_providers_cuda.so
    [ -f "$lib" ] || { echo "no CUDA provider library in $wheel" >&2; exit 1; }
    echo "== compress the CUDA provider library ($(du -m "$lib" | cut -f1) MB)"
    xz -T0 -6 -c "$lib" > "$work/cuda.so.xz"
    rm "$lib"
    (cd "$work" && sha256sum cuda.so.xz > "$G/rest/cuda.sha")
    rm -f "$G"/parts/part*
    split -b "${PART_MIB:-50}M" -d "$work/cuda.so.xz" "$G/parts/part"
    echo "   $(ls "$G"/parts | wc -l) parts: $(ls "$G"/parts | tr '\n' ' ')"
    echo "== the rest of the wheel"
    tar -C "$work/site" -cJf "$G/rest/rest.tar.xz" .
    echo "== wheels the image lacks"
    find "$G/rest" -name '*.whl' ! -name 'trioinfer-*' -delete
    fetch "$G/rest" trio outcome pytest-trio starlette httptools orjson
fi
echo "== trioinfer from this checkout"
rm -f "$G"/rest/trioinfer-*.whl
"$PY" -m pip wheel -q --no-deps --no-build-isolation . -w "$G/rest"
du -sh "$G/rest" "$G"/parts/* | sed 's/^/   /'
echo "a call carries the checkout ($(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1) bytes tracked) and one part or rest: 64 MiB in all"
