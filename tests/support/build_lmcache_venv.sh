#!/usr/bin/env bash
# Build (or reuse) the isolated virtual environment that runs the REAL
# LMCache 0.5.6 MP server and the official SDK for the test suite.
#
#   tests/support/build_lmcache_venv.sh            # venv at <repo>/.lmcache-venv
#   LMCACHE_VENV=/some/dir tests/support/build_lmcache_venv.sh
#
# Recipe (docs: shared reference "real-lmcache-server.md"):
#   1. python3 -m venv VENV
#   2. pip install torch==2.13.0          (CPU build; never a bare "torch")
#   3. pip install --no-deps lmcache==0.5.6
#   4. pip install the server's runtime deps, all pinned through
#      tests/support/lmcache-constraints.txt (exact versions => no backtracking)
#   5. import check
#
# Idempotent: a stamp file inside the venv holds a hash of this script and the
# constraints file (editing either forces a rebuild). If it matches and the
# venv passes a quick probe, the script exits at once (~0.1 s). Otherwise the
# venv is deleted and rebuilt from scratch.
#
# The quick probe checks, without importing torch: the interpreter starts,
# lmcache 0.5.6 and torch 2.13.0 are the installed distributions, the two
# modules of the import check exist, and bin/lmcache exists. The real import
# check (`python -c "import lmcache.v1.multiprocess.http_server,
# lmcache.sdk.kvcache"`) costs ~4 s on a 2-vCPU machine (torch + fastapi), so
# it runs after every build and on the fast path only with --verify (or
# LMCACHE_VENV_VERIFY=1); a failing full check also triggers a rebuild.
#
# Concurrent invocations for the same venv are serialized with flock(1) on
# ${TMPDIR:-/tmp}/lmcache_venv_<hash of the venv path>.lock; a waiter re-checks
# the stamp after the builder finishes.
#
# The last line on stdout is the venv's python path. All pip output goes to
# stderr. Exits non-zero with a message on failure.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_DIR="$(cd "${SCRIPT_DIR}/../.." && pwd)"
CONSTRAINTS="${SCRIPT_DIR}/lmcache-constraints.txt"
VENV="${LMCACHE_VENV:-${REPO_DIR}/.lmcache-venv}"
PY="${VENV}/bin/python"
STAMP="${VENV}/.lmcache_async_stamp"
BASE_PYTHON="${LMCACHE_BASE_PYTHON:-python3}"
IMPORT_CHECK="import lmcache.v1.multiprocess.http_server, lmcache.sdk.kvcache"

die() {
    echo "build_lmcache_venv.sh: ERROR: $*" >&2
    exit 1
}

[[ -f "${CONSTRAINTS}" ]] || die "constraints file missing: ${CONSTRAINTS}"

WANT_HASH="$(cat "${BASH_SOURCE[0]}" "${CONSTRAINTS}" | sha256sum | cut -d' ' -f1)"

# Never import with the cwd inside an lmcache source tree (its logging.py
# shadows the stdlib): run every check from a neutral directory.
import_ok() {
    (cd / && LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 LMCACHE_DISABLE_BANNER=1 \
        "${PY}" -c "${IMPORT_CHECK}") >/dev/null 2>&1
}

# Cheap stand-in for the import check (no torch import): ~0.1 s.
QUICK_PROBE='
import importlib.metadata as md, os, sys
assert md.version("lmcache") == "0.5.6", md.version("lmcache")
assert md.version("torch").split("+")[0] == "2.13.0", md.version("torch")
root = None
for d in sys.path:
    base = os.path.join(d, "lmcache")
    if os.path.isfile(os.path.join(base, "__init__.py")):
        root = base
        break
assert root is not None, "lmcache package not found"
for rel in ("v1/multiprocess/http_server.py", "sdk/kvcache.py"):
    assert os.path.isfile(os.path.join(root, rel)), rel
'
quick_ok() {
    [[ -x "${VENV}/bin/lmcache" ]] || return 1
    (cd / && "${PY}" -I -c "${QUICK_PROBE}") >/dev/null 2>&1
}

VERIFY="${LMCACHE_VENV_VERIFY:-0}"
[[ "${1:-}" == "--verify" ]] && VERIFY=1

stamp_ok() {
    [[ -x "${PY}" && -f "${STAMP}" && "$(cat "${STAMP}")" == "${WANT_HASH}" ]]
}
venv_ok() {
    quick_ok && { [[ "${VERIFY}" != "1" ]] || import_ok; }
}

# ---- fast path (no lock: the stamp is written last) -------------------------
if stamp_ok && venv_ok; then
    echo "${PY}"
    exit 0
fi

# ---- serialize builds of the same venv (e.g. two pytest sessions) -----------
if command -v flock >/dev/null 2>&1; then
    LOCK="${TMPDIR:-/tmp}/lmcache_venv_$(printf '%s' "${VENV}" | sha256sum | cut -c1-16).lock"
    exec 9>"${LOCK}" || die "cannot open lock file ${LOCK}"
    flock -w 1800 9 || die "timed out waiting for another build of ${VENV} (lock ${LOCK})"
    # Another process may have finished the build while we waited.
    if stamp_ok && venv_ok; then
        echo "${PY}"
        exit 0
    fi
else
    echo "build_lmcache_venv.sh: flock not found; concurrent builds are not serialized" >&2
fi
if stamp_ok; then
    echo "build_lmcache_venv.sh: stamp matches but the venv check failed; rebuilding" >&2
fi

# ---- full build ------------------------------------------------------------
command -v "${BASE_PYTHON}" >/dev/null 2>&1 || die "base interpreter '${BASE_PYTHON}' not found"

# Refuse to delete something that is clearly not a venv we own.
if [[ -e "${VENV}" && ! -f "${VENV}/pyvenv.cfg" ]]; then
    if [[ -n "$(ls -A "${VENV}" 2>/dev/null)" ]]; then
        die "${VENV} exists and is not a virtual environment; refusing to delete it"
    fi
fi

START=$(date +%s)
echo "build_lmcache_venv.sh: building lmcache 0.5.6 venv at ${VENV}" >&2
rm -rf "${VENV}"

"${BASE_PYTHON}" -m venv "${VENV}" >&2 || die "python3 -m venv ${VENV} failed"

# -q: errors still shown. pip also prints "lmcache 0.5.6 requires cupy-cuda13x, ... which is
# not installed" for the deliberately skipped CUDA/extra deps; that is expected (exit 0).
PIP=("${PY}" -m pip --disable-pip-version-check --no-input -q)

step() {
    local what="$1"
    shift
    echo "build_lmcache_venv.sh: ${what}" >&2
    if ! (cd / && "$@") >&2; then
        rm -f "${STAMP}"
        die "${what} failed (command: $*)"
    fi
}

# 1. torch first, pinned (a bare torch would pull a multi-GB CUDA build).
step "pip install torch==2.13.0" \
    "${PIP[@]}" install -c "${CONSTRAINTS}" "torch==2.13.0"
# 2. lmcache without its CUDA-heavy metadata dependencies.
step "pip install --no-deps lmcache==0.5.6" \
    "${PIP[@]}" install --no-deps "lmcache==0.5.6"
# 3. what the MP server + SDK import on CPU, at the exact recorded versions.
step "pip install server dependencies" \
    "${PIP[@]}" install -c "${CONSTRAINTS}" \
    "torch==2.13.0" fastapi uvicorn httpx requests "pyzmq>=25.0.0" "numpy<=2.2.6" \
    msgspec blake3 psutil pyyaml "prometheus_client>=0.18.0,<=0.24.1" \
    sortedcontainers numba cachetools py-cpuinfo aiohttp cryptography \
    "setuptools>=77.0.3,<81.0.0" "opentelemetry-api>=1.20.0,<=1.40.0" \
    "opentelemetry-sdk>=1.20.0" "opentelemetry-exporter-prometheus>=0.50b0,<=0.61b0"

# 4. import check.
if ! OUT="$(cd / && LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 LMCACHE_DISABLE_BANNER=1 \
        "${PY}" -c "${IMPORT_CHECK}" 2>&1)"; then
    echo "${OUT}" >&2
    die "import check failed: ${PY} -c '${IMPORT_CHECK}'"
fi
[[ -x "${VENV}/bin/lmcache" ]] || die "console script ${VENV}/bin/lmcache is missing"

echo "${WANT_HASH}" > "${STAMP}"
echo "build_lmcache_venv.sh: done in $(( $(date +%s) - START )) s" >&2
echo "${PY}"
