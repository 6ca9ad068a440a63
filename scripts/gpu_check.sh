#!/usr/bin/env bash
# Every check that needs a GPU, in one go, within ${GPU_CHECK_BUDGET_S:-540} seconds:
#
#   1. the Python to run under (see "Where it runs" below);
#   2. the environment: an nvidia-smi summary (when installed), the versions, and a preflight
#      that FAILS when torch or cuda-python cannot use a device (otherwise every gpu-marked test
#      would skip and the run would look green);
#   3. every gpu-marked test: the files under tests/ with `pytest.mark.gpu` (the CUDA pool and
#      its restart, the stream-ordered fences, the vLLM copies, the kernels, the end-to-end worker,
#      the dedicated partitions), run with `-m gpu`, a JUnit report, and one summary line per file;
#   4. bench/gpu_decode.py (paged decode against SDPA, and the split sweep at small batch) and
#      bench/gpu_tier_copies.py (the tiers' loads into the cuda pool against the link's peak,
#      through pinned host memory; its log joins gpu_decode.log);
#   5. the tenant-isolation suite (tests/security; mostly CPU-side: it runs in CI too), with the
#      time that is left.
#
# Where it runs:
#   - with .venv (`make install`): that venv;
#   - without one, with wheels in .whl (scripts/gpu_wheels.sh makes them where pip can reach an
#     index): the machine's python3 (an image with torch, triton and cuda-bindings), the wheels
#     installed with `pip --no-index --target` into ${WHEELS_TARGET:-/tmp/blockd-site};
#   - otherwise: `make install` first (outside the budget);
#   - PY=... overrides all of that.
#   The checkout's packages (blockd, clients, apps, gpu) are put on PYTHONPATH, so nothing needs
#   installing from the checkout itself.
#
# On this workplace's device machine (no index, no .venv: it does not travel): here
# `scripts/gpu_wheels.sh`, then run `OUT=$OUT bash scripts/gpu_check.sh` there with `.whl`
# carried and a timeout above the budget.
#
# Outputs (at most 8 files: env.log, pytest.log, gpu_tests.xml, gpu_decode.log,
# gpu_decode.json, gpu_tiers.json, isolation.log, gpu_check_summary.txt) go to
# ${OUT:-bench/results}. Each step runs under `timeout`, at most its own limit and at most what is left of the budget; override a
# limit with STEP_TIMEOUT_<NAME> (seconds), e.g. STEP_TIMEOUT_PYTEST=400. Exits non-zero when any
# step failed or did not run for want of time (the others still run).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$(pwd)"
OUT_DIR="${OUT:-bench/results}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
SUMMARY="$OUT_DIR/gpu_check_summary.txt"
for f in env.log pytest.log gpu_tests.xml gpu_decode.log gpu_decode.json gpu_tiers.json \
         isolation.log; do
    rm -f "${OUT_DIR:?}/$f"
done
: >"$SUMMARY"
failed=()
deadline=""

# run_step NAME LOG SECONDS CMD...: run CMD under timeout, append its output to $OUT_DIR/LOG,
# record ok/FAILED with the exit status (124, or 137 after --kill-after, is a timeout). Once the
# budget has started, SECONDS is cut to what is left of it; with under 15 s left the step is
# not run and counts as failed.
run_step() {
    local name=$1 log=$2 seconds=$3
    shift 3
    local var="STEP_TIMEOUT_${name^^}"
    seconds=${!var:-$seconds}
    if [[ -n $deadline ]]; then
        local left=$((deadline - SECONDS))
        if ((left < 15)); then
            echo "FAILED  $name (not run: the ${BUDGET}s budget is spent)" | tee -a "$SUMMARY"
            failed+=("$name")
            return 0
        fi
        ((seconds > left)) && seconds=$left
    fi
    echo "=== $name (timeout ${seconds}s): $*" | tee -a "$OUT_DIR/$log"
    local rc=0 t0=$SECONDS
    timeout --kill-after=10 "$seconds" "$@" 2>&1 | tee -a "$OUT_DIR/$log" || rc=$?
    if [[ $rc -eq 0 ]]; then
        echo "ok      $name ($((SECONDS - t0))s)" | tee -a "$SUMMARY"
    else
        local why="exit $rc"
        if [[ $rc -eq 124 || $rc -eq 137 ]]; then
            why="$why, timed out after ${seconds}s"
        fi
        echo "FAILED  $name ($why)" | tee -a "$SUMMARY"
        failed+=("$name")
    fi
}

# -- 1. the Python ---------------------------------------------------------------------------
if [[ -n ${PY:-} ]]; then
    :
elif [[ -x .venv/bin/python ]]; then
    PY=.venv/bin/python
elif compgen -G ".whl/*.whl" >/dev/null; then
    PY=python3
    SITE="${WHEELS_TARGET:-/tmp/blockd-site}"
    run_step wheels env.log 120 "$PY" -m pip install -q --no-index --no-deps --no-compile \
        --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
    run_step install env.log 1800 make install
    PY=.venv/bin/python
fi
export PYTHONPATH="$ROOT:$ROOT/clients:$ROOT/apps:$ROOT/gpu${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if ! command -v "$PY" >/dev/null 2>&1; then
    echo "no usable Python ($PY); nothing else can run" | tee -a "$SUMMARY"
    exit 1
fi

BUDGET="${GPU_CHECK_BUDGET_S:-540}"
deadline=$((SECONDS + BUDGET))

# -- 2. the environment ----------------------------------------------------------------------
if command -v nvidia-smi >/dev/null 2>&1; then
    run_step nvidia_smi env.log 30 nvidia-smi \
        --query-gpu=index,name,uuid,memory.total,memory.used,driver_version \
        --format=csv
else
    echo "nvidia-smi not installed; skipping the summary" | tee -a "$SUMMARY"
fi

# shellcheck disable=SC2016  # the Python code is single-quoted on purpose
run_step preflight env.log 120 "$PY" -c '
import sys
from importlib.metadata import version
import torch
from blockd.pools.cuda import cuda_unavailable_reason
print("python", sys.version.split()[0], sys.executable)
for dist in ("torch", "triton", "grpcio", "protobuf", "pyzmq", "cuda-bindings", "numpy"):
    try:
        print(f"  {dist} {version(dist)}")
    except Exception as exc:
        print(f"  {dist}: {exc!r}")
import blockd, blockd_apps, blockd_client, blockd_gpu, blockd.api.v1.blockd_pb2  # noqa: F401
print("torch cuda", torch.version.cuda,
      "devices", torch.cuda.device_count() if torch.cuda.is_available() else 0,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
reason = cuda_unavailable_reason()
print("cuda pool:", reason or "available")
if reason or not torch.cuda.is_available():
    sys.exit("no usable CUDA device: the gpu tests would all skip")
'

# -- 3. every gpu-marked test ----------------------------------------------------------------
# Only the files that hold gpu tests are collected: the rest of the suite imports packages
# (vllm, msgspec, cryptography, ...) a GPU image need not have, and none of it is selected.
mapfile -t gpu_files < <(grep -rlE 'pytest\.mark\.gpu' tests --include='test_*.py' | sort)
run_step pytest pytest.log 360 "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider \
    --junitxml="$OUT_DIR/gpu_tests.xml" "${gpu_files[@]}"

# One summary line per file (they ran inside the pytest step above).
if [[ -f "$OUT_DIR/gpu_tests.xml" ]]; then
    "$PY" - "$OUT_DIR/gpu_tests.xml" <<'EOF' | tee -a "$SUMMARY" || true
import collections
import sys
import xml.etree.ElementTree as ET

per = collections.defaultdict(lambda: [0, 0, 0])  # passed, failed, skipped
for case in ET.parse(sys.argv[1]).iter("testcase"):
    module = case.get("classname", "").rsplit(".", 1)[-1]
    if case.find("failure") is not None or case.find("error") is not None:
        per[module][1] += 1
    elif case.find("skipped") is not None:
        per[module][2] += 1
    else:
        per[module][0] += 1
for module, (ok, bad, skip) in sorted(per.items()):
    state = "FAILED " if bad else ("skipped" if not ok else "ok     ")
    print(f"{state} {module} ({ok} passed, {bad} failed, {skip} skipped)")
EOF
fi

# -- 4. the decode benchmark -----------------------------------------------------------------
if [[ -f bench/gpu_decode.py ]]; then
    run_step gpu_decode gpu_decode.log 300 "$PY" bench/gpu_decode.py \
        --out "$OUT_DIR/gpu_decode.json"
else
    echo "bench/gpu_decode.py not present; skipping the benchmark" | tee -a "$SUMMARY"
fi
run_step gpu_tiers gpu_decode.log 120 "$PY" bench/gpu_tier_copies.py \
    --out "$OUT_DIR/gpu_tiers.json"

# -- 5. tenant isolation (issue 14) ----------------------------------------------------------
# Dedicated partitions on the cuda pool ran in step 3 (tests/security/test_gpu_partitions.py);
# here the whole isolation suite runs on this machine (the hostile scan from another uid, the
# handle socket's peer check and bounds, recovery inside a partition).
run_step isolation isolation.log 180 "$PY" -m pytest -q -rs -p no:cacheprovider -m "not gpu" \
    tests/security

echo "=== summary ($SUMMARY, $((SECONDS))s in all)"
cat "$SUMMARY"
if [[ ${#failed[@]} -gt 0 ]]; then
    echo "gpu_check: FAILED: ${failed[*]}"
    exit 1
fi
echo "gpu_check: all checks passed"
