#!/usr/bin/env bash
# The wheels scripts/gpu_check.sh needs on a GPU machine that cannot reach a package index.
#
# Such a machine's image has python3 with torch, triton, cuda-bindings, numpy, pyyaml,
# prometheus-client, msgpack, xxhash, psutil, pytest and hypothesis, but not blockd's gRPC stack
# at the versions its generated code needs (grpcio 1.85.1 and protobuf >= 7.35), nor pyzmq. This
# downloads those wheels, at the exact versions this checkout's .venv runs (the ones CI tests),
# into ${WHEELS_DIR:-.whl}, for CPython ${WHEELS_PYTHON:-3.12} on x86-64 Linux. Run it here, where
# pip can reach the index; then take the folder to the GPU machine with the working tree, where
# gpu_check.sh installs it (pip --no-index --target) when there is no .venv.
#
#   scripts/gpu_wheels.sh                 # needs .venv (make install) for the versions
#   WHEELS_PYTHON=3.11 scripts/gpu_wheels.sh
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
DEST="${WHEELS_DIR:-.whl}"
PYV="${WHEELS_PYTHON:-3.12}"
VENV_PY=.venv/bin/python
# Every distribution the daemon, the client and the gpu-marked tests import that the image may
# lack or hold at another version. Pure-Python ones are fine too: --only-binary takes their
# py3-none-any wheels.
PACKAGES=(grpcio grpcio-health-checking grpcio-reflection protobuf pyzmq)

if [[ ! -x $VENV_PY ]]; then
    echo "gpu_wheels: no $VENV_PY to read the versions from; run 'make install' first" >&2
    exit 1
fi

pins=()
for name in "${PACKAGES[@]}"; do
    version=$("$VENV_PY" -c 'import sys; from importlib.metadata import version
print(version(sys.argv[1]))' "$name")
    pins+=("$name==$version")
done

platforms=()
for p in manylinux_2_39_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 \
         manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done

rm -rf "$DEST"
mkdir -p "$DEST"
"$VENV_PY" -m pip download --quiet --no-deps --only-binary=:all: \
    --python-version "$PYV" --implementation cp "${platforms[@]}" -d "$DEST" "${pins[@]}"
echo "gpu_wheels: ${pins[*]} for CPython $PYV in $DEST ($(du -sh "$DEST" | cut -f1))"
