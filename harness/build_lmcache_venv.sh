#!/usr/bin/env bash
# Build (or reuse) the isolated virtual environment that runs the REAL
# LMCache MP server and the official SDK for the test suite, for one of the
# two server generations this project supports:
#
#   harness/build_lmcache_venv.sh            # 0.5.6 at <repo>/.lmcache-venv
#   harness/build_lmcache_venv.sh --generation 0.5.7   # at <repo>/.lmcache-venv-057
#   LMCACHE_GENERATION=0.5.7 harness/build_lmcache_venv.sh   # the same
#   LMCACHE_VENV=/some/dir harness/build_lmcache_venv.sh     # 0.5.6 elsewhere
#   LMCACHE_VENV_057=/some/dir harness/build_lmcache_venv.sh --generation 0.5.7
#
# Recipe for 0.5.6 (docs: shared reference "real-lmcache-server.md"):
#   1. python3 -m venv VENV
#   2. pip install torch==2.13.0          (CPU build; never a bare "torch")
#   3. pip install --no-deps lmcache==0.5.6
#   4. pip install the server's runtime deps, all pinned through
#      harness/lmcache-constraints.txt (exact versions => no backtracking)
#   5. import check
#
# Recipe for 0.5.7 (the 0.5.7rc3 build; shared reference "lmcache-0.5.7.md"):
#   1-2. as above
#   3. pip install --no-deps lmcache-cli==0.5.7rc3.dev0 (a pure-Python wheel
#      holding the whole lmcache package, without compiled extensions)
#   4. the same dependencies plus msgpack, pinned through
#      harness/lmcache-constraints-057.txt
#   5. pip download --no-deps lmcache==0.5.6 and copy its four lmcache/*.so
#      into the 0.5.7 package (they load and serve on CPU: they differ from
#      0.5.7's sources by one enum value, used only by one GPU KV-format spec)
#   6. delete that one spec (kv_format/specs/nl_x_nb_two_nh_one_bs_hs.py;
#      specs are auto-discovered at import and it names the newer enum value)
#   7. import check
#
# Idempotent: a stamp file inside the venv holds a hash of the generation's
# recipe (see recipe() below: distributions, dependency line, constraints file,
# import check; editing any of them forces a rebuild of that generation only).
# If it matches and the venv passes a quick probe, the script exits at once
# (~0.1 s). Otherwise the venv is deleted and rebuilt from scratch. Each
# generation has its own venv, stamp and lock; both can be built side by side.
#
# The quick probe checks, without importing torch: the interpreter starts,
# the generation's lmcache distribution and torch 2.13.0 are installed, the two
# modules of the import check exist, (0.5.7) the four grafted extensions are
# there, and bin/lmcache exists. The real import
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
REPO_DIR="$(cd "${SCRIPT_DIR}/.." && pwd)"

die() {
    echo "build_lmcache_venv.sh: ERROR: $*" >&2
    exit 1
}

GENERATION="${LMCACHE_GENERATION:-0.5.6}"
VERIFY="${LMCACHE_VENV_VERIFY:-0}"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --verify) VERIFY=1 ;;
        --generation) [[ $# -ge 2 ]] || die "--generation needs a value (0.5.6 or 0.5.7)"
                      GENERATION="$2"; shift ;;
        --generation=*) GENERATION="${1#--generation=}" ;;
        *) die "unknown argument: $1 (known: --generation 0.5.6|0.5.7, --verify)" ;;
    esac
    shift
done

# Per generation: default venv dir, pinned constraints, the distribution pip
# installs (--no-deps), the version importlib.metadata must report for it.
case "${GENERATION}" in
    0.5.6)
        VENV="${LMCACHE_VENV:-${REPO_DIR}/.lmcache-venv}"
        CONSTRAINTS="${SCRIPT_DIR}/lmcache-constraints.txt"
        DIST="lmcache"
        DIST_VERSION="0.5.6"
        EXTRA_DEPS=()
        ;;
    0.5.7)
        VENV="${LMCACHE_VENV_057:-${REPO_DIR}/.lmcache-venv-057}"
        CONSTRAINTS="${SCRIPT_DIR}/lmcache-constraints-057.txt"
        DIST="lmcache-cli"
        DIST_VERSION="0.5.7rc3.dev0"
        EXTRA_DEPS=(msgpack)
        ;;
    *) die "unknown generation '${GENERATION}' (known: 0.5.6, 0.5.7)" ;;
esac
# The wheel whose compiled extensions the 0.5.7 venv borrows (step 5).
EXT_WHEEL_SPEC="lmcache==0.5.6"
# The one 0.5.7 KV-format spec the 0.5.6 extensions cannot load (step 6).
DROPPED_SPEC="v1/gpu_connector/kv_format/specs/nl_x_nb_two_nh_one_bs_hs.py"

PY="${VENV}/bin/python"
STAMP="${VENV}/.lmcache_async_stamp"
BASE_PYTHON="${LMCACHE_BASE_PYTHON:-python3}"
IMPORT_CHECK="import lmcache.v1.multiprocess.http_server, lmcache.sdk.kvcache"

[[ -f "${CONSTRAINTS}" ]] || die "constraints file missing: ${CONSTRAINTS}"

# What the server and SDK import on CPU (step 4 of both recipes), pinned by CONSTRAINTS.
SERVER_DEPS=(
    "torch==2.13.0" fastapi uvicorn httpx requests "pyzmq>=25.0.0" "numpy<=2.2.6"
    msgspec blake3 psutil pyyaml "prometheus_client>=0.18.0,<=0.24.1"
    sortedcontainers numba cachetools py-cpuinfo aiohttp cryptography
    "setuptools>=77.0.3,<81.0.0" "opentelemetry-api>=1.20.0,<=1.40.0"
    "opentelemetry-sdk>=1.20.0" "opentelemetry-exporter-prometheus>=0.50b0,<=0.61b0"
)

# The stamp hashes the recipe, not this file: every input that shapes the venv
# (generation, distributions, dependency line, constraints, import check, the
# 0.5.7 extension graft) is in it, so editing one generation's recipe rebuilds
# only that generation. Bump RECIPE_REVISION for any other change to the steps.
RECIPE_REVISION=1
recipe() {
    printf '%s\n' "revision ${RECIPE_REVISION}" "generation ${GENERATION}" \
        "dist ${DIST}==${DIST_VERSION}" "deps ${SERVER_DEPS[*]} ${EXTRA_DEPS[*]-}" \
        "import ${IMPORT_CHECK}"
    if [[ "${GENERATION}" == "0.5.7" ]]; then
        printf '%s\n' "extensions ${EXT_WHEEL_SPEC}" "drop ${DROPPED_SPEC}" "${GRAFT_SO}"
    fi
    cat "${CONSTRAINTS}"
}

# Copies the four lmcache/*.so of the 0.5.6 wheel (argv[1]: its directory)
# into the 0.5.7 package (argv[2]).
GRAFT_SO='
import glob, os, sys, zipfile
wheel_dir, pkg = sys.argv[1:3]
wheels = glob.glob(os.path.join(wheel_dir, "lmcache-0.5.6-*.whl"))
assert len(wheels) == 1, wheels
with zipfile.ZipFile(wheels[0]) as zf:
    names = [n for n in zf.namelist() if n.startswith("lmcache/") and n.count("/") == 1 and n.endswith(".so")]
    assert len(names) == 4, names
    for n in names:
        with zf.open(n) as src, open(os.path.join(pkg, os.path.basename(n)), "wb") as dst:
            dst.write(src.read())
'

WANT_HASH="$(recipe | sha256sum | cut -d' ' -f1)"
# A 0.5.6 venv stamped by this script's previous revision (which hashed the whole
# script; its 0.5.6 recipe is the one above) is accepted while the constraints
# file is unchanged, so the split into generations did not force a rebuild.
LEGACY_056_STAMP="a6d409e240467b225872f7015dd0b65d9f0d0f925d02db3fb88d739ab755b805"
LEGACY_056_CONSTRAINTS="fb16bccf99b1de154177b46109ace7513b8dfebb6967ce617b3da78314049cae"

# Never import with the cwd inside an lmcache source tree (its logging.py
# shadows the stdlib): run every check from a neutral directory.
import_ok() {
    (cd / && LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 LMCACHE_DISABLE_BANNER=1 \
        "${PY}" -c "${IMPORT_CHECK}") >/dev/null 2>&1
}

# Cheap stand-in for the import check (no torch import): ~0.1 s.
QUICK_PROBE='
import importlib.metadata as md, os, sys
dist, want, generation = sys.argv[1:4]
assert md.version(dist) == want, md.version(dist)
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
if generation == "0.5.7":
    sos = [n for n in os.listdir(root) if n.endswith(".so")]
    assert len(sos) == 4, sos
'
quick_ok() {
    [[ -x "${VENV}/bin/lmcache" ]] || return 1
    (cd / && "${PY}" -I -c "${QUICK_PROBE}" "${DIST}" "${DIST_VERSION}" "${GENERATION}") >/dev/null 2>&1
}

stamp_ok() {
    [[ -x "${PY}" && -f "${STAMP}" ]] || return 1
    local have
    have="$(cat "${STAMP}")"
    [[ "${have}" == "${WANT_HASH}" ]] && return 0
    [[ "${GENERATION}" == "0.5.6" && "${have}" == "${LEGACY_056_STAMP}" \
        && "$(sha256sum < "${CONSTRAINTS}" | cut -d' ' -f1)" == "${LEGACY_056_CONSTRAINTS}" ]]
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
echo "build_lmcache_venv.sh: building the lmcache ${GENERATION} venv at ${VENV}" >&2
rm -rf "${VENV}"

"${BASE_PYTHON}" -m venv "${VENV}" >&2 || die "python3 -m venv ${VENV} failed"

# -q: errors still shown.
PIP=("${PY}" -m pip --disable-pip-version-check --no-input -q)
# Installs go through uv where one is found (harness/fast_pip.py; pip otherwise), without
# bytecode: the import check below compiles what the server imports, once.
INSTALL=("${PY}" "${SCRIPT_DIR}/fast_pip.py" "${PY}" -q --no-compile)

# After step 3 pip reports every dependency that ${DIST}'s metadata declares and step 2's
# --no-deps left out ("ERROR: pip's dependency resolver does not currently take into
# account ...", then "lmcache 0.5.6 requires cupy-cuda13x, which is not installed." and
# ~20 more): they are expected, so they are folded into one note. Every other line,
# another conflict included (with the report's first line), passes through.
FOLD_SKIPPED_DEPS='
/^ERROR: pip.s (legacy )?dependency resolver / { report = 1; header = $0; next }
report && $3 == "requires" && /which is (not installed|incompatible)\.$/ {
    if ($1 == dist && /, which is not installed\.$/) { skipped++; version = $2; next }
    if (header != "") { print header; header = "" }
    print
    next
}
{ report = 0; header = ""; print }
END {
    if (skipped) printf "build_lmcache_venv.sh: pip reports %d dependencies of %s %s as not installed: " \
        "expected, they are left out on purpose (CUDA and optional packages that the server and SDK " \
        "do not need on CPU)\n", skipped, dist, version
}'

# Runs one step, its output (stdout too) on stderr through FOLD_SKIPPED_DEPS; pipefail
# keeps the step's exit status.
step() {
    local what="$1"
    shift
    echo "build_lmcache_venv.sh: ${what}" >&2
    if ! (cd / && "$@") 2>&1 | awk -v dist="${DIST}" "${FOLD_SKIPPED_DEPS}" >&2; then
        rm -f "${STAMP}"
        die "${what} failed (command: $*)"
    fi
}

# 1. torch first, pinned (a bare torch would pull a multi-GB CUDA build).
step "pip install torch==2.13.0" \
    "${INSTALL[@]}" -c "${CONSTRAINTS}" "torch==2.13.0"
# 2. lmcache without its CUDA-heavy metadata dependencies.
step "pip install --no-deps ${DIST}==${DIST_VERSION}" \
    "${INSTALL[@]}" --no-deps "${DIST}==${DIST_VERSION}"
# 3. what the MP server + SDK import on CPU, at the exact recorded versions.
step "pip install server dependencies" \
    "${INSTALL[@]}" -c "${CONSTRAINTS}" "${SERVER_DEPS[@]}" ${EXTRA_DEPS[@]+"${EXTRA_DEPS[@]}"}

if [[ "${GENERATION}" == "0.5.7" ]]; then
    SITE="$(cd / && "${PY}" -I -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
        || die "cannot find the site-packages of ${VENV}"
    PKG="${SITE}/lmcache"
    [[ -d "${PKG}" ]] || die "lmcache package missing at ${PKG}"
    WHEEL_DIR="$(mktemp -d "${TMPDIR:-/tmp}/lmcache_ext_wheel.XXXXXX")"
    trap 'rm -rf "${WHEEL_DIR}"' EXIT
    # 0.5.7 step 5: the compiled extensions of the 0.5.6 wheel (0.5.7rc3's has none).
    step "pip download --no-deps ${EXT_WHEEL_SPEC}" \
        "${PIP[@]}" download --no-deps --only-binary=:all: -d "${WHEEL_DIR}" "${EXT_WHEEL_SPEC}"
    step "copy the 0.5.6 wheel's lmcache/*.so into ${PKG}" \
        "${PY}" -I -c "${GRAFT_SO}" "${WHEEL_DIR}" "${PKG}"
    # 0.5.7 step 6: drop the one KV-format spec that names the newer enum value.
    rm -f "${PKG}/${DROPPED_SPEC}"
    [[ ! -e "${PKG}/${DROPPED_SPEC}" ]] || die "could not delete ${PKG}/${DROPPED_SPEC}"
fi

# Last step of both recipes: the import check.
if ! OUT="$(cd / && PYTHONDONTWRITEBYTECODE= LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 LMCACHE_DISABLE_BANNER=1 \
        "${PY}" -c "${IMPORT_CHECK}" 2>&1)"; then
    echo "${OUT}" >&2
    die "import check failed: ${PY} -c '${IMPORT_CHECK}'"
fi
[[ -x "${VENV}/bin/lmcache" ]] || die "console script ${VENV}/bin/lmcache is missing"

echo "${WANT_HASH}" > "${STAMP}"
echo "build_lmcache_venv.sh: done in $(( $(date +%s) - START )) s" >&2
echo "${PY}"
