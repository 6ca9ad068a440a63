#!/usr/bin/env bash
# Fetch SGLang's wheel for bench/peers_replay.py without installing it: its RadixCache and
# paged allocator are pure Python, but installing sglang would pull its whole serving stack
# (and pins of torch and friends that conflict with this venv). The wheel is unpacked under
# bench/peers/.cache/ and bench/peers/sglang_loader.py puts it on sys.path.
set -euo pipefail
VERSION="${SGLANG_VERSION:-0.5.23}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PY:-$HERE/../../.venv/bin/python}"
DEST="$HERE/.cache"
mkdir -p "$DEST"
if ! ls "$DEST"/sglang-"$VERSION"-*.whl >/dev/null 2>&1; then
    "$PY" -m pip download --quiet --no-deps "sglang==$VERSION" -d "$DEST"
fi
"$PY" "$HERE/sglang_loader.py" --unpack
