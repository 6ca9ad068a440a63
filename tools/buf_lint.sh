#!/usr/bin/env bash
# Lint the protobuf API with buf (rules: proto/buf.yaml, STANDARD set).
#
# buf is taken from, in order: $BUF; .tools/node_modules/.bin/buf (if it is the pinned
# version); otherwise the pinned @bufbuild/buf npm package is installed into .tools/ (git-ignored,
# no package.json or lock file written).
#
# Exit status: 0 = clean; buf's own status on lint errors (100) or other buf failures;
# 3 = buf unavailable (no npm, or the install failed; e.g. offline).
set -euo pipefail

BUF_VERSION="1.75.0"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tools_dir="${repo_root}/.tools"
local_buf="${tools_dir}/node_modules/.bin/buf"

if [[ -n "${BUF:-}" ]]; then
  buf="${BUF}"
else
  buf="${local_buf}"
  if [[ ! -x "${buf}" ]] || [[ "$("${buf}" --version 2>/dev/null)" != "${BUF_VERSION}" ]]; then
    if ! command -v npm >/dev/null 2>&1; then
      echo "buf_lint: buf not found and npm is missing; install Node.js or set BUF=/path/to/buf" >&2
      exit 3
    fi
    echo "buf_lint: installing @bufbuild/buf@${BUF_VERSION} into ${tools_dir}" >&2
    mkdir -p "${tools_dir}"
    if ! npm install --no-save --no-package-lock --no-audit --no-fund --silent \
        --prefix "${tools_dir}" "@bufbuild/buf@${BUF_VERSION}" >&2; then
      echo "buf_lint: npm install of @bufbuild/buf@${BUF_VERSION} failed" >&2
      exit 3
    fi
    if [[ ! -x "${buf}" ]]; then
      echo "buf_lint: npm install did not provide ${buf}" >&2
      exit 3
    fi
  fi
fi

cd "${repo_root}/proto"
"${buf}" lint
echo "buf_lint: OK (buf $("${buf}" --version))"
