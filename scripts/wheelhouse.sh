#!/usr/bin/env bash
# wheelhouse.sh: fill .wheelhouse/ with the wheels the asyncps image needs.
#
# Why: `docker build` then installs with `pip --no-index --find-links` from the
# build context, so the image build needs no network and is fast to repeat
# (pip inside a container may not reach the package index at all).
#
# What it does:
#   1. builds the project wheel (`pip wheel --no-deps`) from a clean copy of the
#      tree into .wheelhouse/project/ (a check that the project packages, and a
#      complete offline set together with 2.; the Docker image builds the
#      project from its source, so it never holds a stale wheel);
#   2. `pip download`s, as binary wheels for the image's platform (Linux
#      x86_64, CPython 3.11, manylinux up to the base image's glibc), the
#      runtime dependencies in pyproject.toml's [project] dependencies, its `cpu` extra and the
#      build requirements in [build-system] requires, with everything they
#      depend on, into .wheelhouse/. The lists are read from pyproject.toml with
#      tomllib and their markers evaluated for the target platform (so the
#      x86_64 one, tensorflow-cpu, is chosen), never duplicated here.
#
# Idempotent: step 2 is skipped while .wheelhouse/.stamp matches the
# requirement set and platform (use --refresh to download anyway, --clean to
# start empty). .wheelhouse/ is gitignored.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$ROOT/.wheelhouse"
PY_VERSION="3.11"
GLIBC="2.36"          # Debian bookworm's glibc (the base image)
ARCH="x86_64"
REFRESH=0
CLEAN=0

usage() {
    cat <<EOF
Usage: scripts/wheelhouse.sh [options]

Download the wheels for asyncps and its runtime dependencies for the Docker
image's platform into .wheelhouse/ (used by 'docker build' when present).

Options:
  --dest DIR             wheelhouse directory (default: .wheelhouse)
  --python-version X.Y   target CPython version (default: ${PY_VERSION})
  --glibc X.Y            newest manylinux glibc the image has (default: ${GLIBC}, bookworm)
  --refresh              download even when the stamp says the wheelhouse is filled
  --clean                empty the wheelhouse first
  -h, --help             show this help

Environment: PYTHON  interpreter whose pip is used (default: .venv/bin/python,
             else python3; needs Python >= 3.11 for tomllib). pip's own
             settings (PIP_INDEX_URL, PIP_CONSTRAINT, ...) apply as usual.
EOF
}

while [[ $# -gt 0 ]]; do
    case "$1" in
        --dest) DEST="${2:?--dest needs a value}"; shift 2 ;;
        --dest=*) DEST="${1#*=}"; shift ;;
        --python-version) PY_VERSION="${2:?--python-version needs a value}"; shift 2 ;;
        --python-version=*) PY_VERSION="${1#*=}"; shift ;;
        --glibc) GLIBC="${2:?--glibc needs a value}"; shift 2 ;;
        --glibc=*) GLIBC="${1#*=}"; shift ;;
        --refresh) REFRESH=1; shift ;;
        --clean) CLEAN=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "wheelhouse.sh: unknown argument: $1" >&2; usage >&2; exit 2 ;;
    esac
done

log() { printf '[wheelhouse] %s\n' "$*" >&2; }
run() { printf '[wheelhouse] + %s\n' "$*" >&2; "$@"; }
die() { printf '[wheelhouse] error: %s\n' "$*" >&2; exit 1; }

if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
"$PYTHON" -c 'import sys, tomllib' 2>/dev/null || die "$PYTHON lacks tomllib (needs Python >= 3.11)"
"$PYTHON" -m pip --version >/dev/null 2>&1 || die "$PYTHON has no pip"

[[ "$PY_VERSION" =~ ^3\.([0-9]+)$ ]] || die "--python-version must look like 3.11"
PY_MINOR="${BASH_REMATCH[1]}"
[[ "$GLIBC" =~ ^2\.([0-9]+)$ ]] || die "--glibc must look like 2.36"
GLIBC_MINOR="${BASH_REMATCH[1]}"

start=$SECONDS
if [[ "$CLEAN" -eq 1 && -d "$DEST" ]]; then
    log "emptying $DEST"
    rm -rf "$DEST"
fi
mkdir -p "$DEST/project"

# 1. The project wheel, built from a clean copy: an in-tree build would reuse
#    build/lib, which keeps modules deleted from the source.
tmp="$(mktemp -d "${TMPDIR:-/tmp}/asyncps-wheel.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
tar -C "$ROOT" \
    --exclude=./.git --exclude=./.venv --exclude=./.venv-proto --exclude=./.venv-floors --exclude=./.wheelhouse --exclude=./build \
    --exclude=./dist --exclude=./runs --exclude=./bench-results --exclude='*.egg-info' \
    --exclude=__pycache__ --exclude=.mypy_cache --exclude=.ruff_cache \
    --exclude=.pytest_cache --exclude=.hypothesis -c . | tar -C "$tmp" -x
rm -f "$DEST"/project/*.whl
run "$PYTHON" -m pip wheel --quiet --no-deps --wheel-dir "$DEST/project" "$tmp"
log "project wheel: $(cd "$DEST/project" && ls ./*.whl)"

# 2. Third-party wheels. Requirements come from pyproject.toml, with their
#    markers evaluated for the target (not this host).
reqs="$DEST/requirements.in"
"$PYTHON" - "$ROOT/pyproject.toml" "$PY_VERSION" "$ARCH" >"$reqs.tmp" <<'PY'
import sys, tomllib
try:
    from packaging.requirements import Requirement
except ImportError:  # pip always carries a copy
    from pip._vendor.packaging.requirements import Requirement

path, py_version, arch = sys.argv[1:4]
with open(path, "rb") as f:
    data = tomllib.load(f)
env = {
    "python_version": py_version,
    "python_full_version": py_version + ".0",
    "implementation_name": "cpython",
    "implementation_version": py_version + ".0",
    "platform_python_implementation": "CPython",
    "platform_machine": arch,
    "platform_system": "Linux",
    "sys_platform": "linux",
    "os_name": "posix",
    "extra": "",
}
print("# generated by scripts/wheelhouse.sh from pyproject.toml for "
      f"cp{py_version.replace('.', '')} linux {arch}; do not edit")
# the image's TensorFlow is the CPU build: the `cpu` extra (see the Dockerfile's deps stage)
wanted = (data["project"].get("dependencies", []) + data["project"]["optional-dependencies"]["cpu"]
          + data.get("build-system", {}).get("requires", []))
for spec in wanted:
    req = Requirement(spec)
    if req.marker is not None and not req.marker.evaluate(env):
        continue
    req.marker = None
    print(req)
PY
mv "$reqs.tmp" "$reqs"
log "requirements for the image ($reqs):"
grep -v '^#' "$reqs" | sed 's/^/[wheelhouse]     /' >&2

# pip accepts several --platform tags; list every manylinux the image's glibc
# runs (PEP 600 names plus the legacy aliases), newest first.
platforms=()
for ((m = GLIBC_MINOR; m >= 5; m--)); do
    platforms+=(--platform "manylinux_2_${m}_${ARCH}")
done
platforms+=(--platform "manylinux2014_${ARCH}" --platform "manylinux2010_${ARCH}" --platform "manylinux1_${ARCH}")

download=("$PYTHON" -m pip download --dest "$DEST" --only-binary=:all:
    --python-version "$PY_VERSION" --implementation cp --abi "cp3${PY_MINOR}"
    "${platforms[@]}" --requirement "$reqs")

stamp="$( { cat "$reqs"; printf '%s\n' "${download[@]:1}"; } | sha256sum | cut -d' ' -f1)"
if [[ "$REFRESH" -eq 0 && -f "$DEST/.stamp" && "$(cat "$DEST/.stamp")" == "$stamp" ]] \
    && compgen -G "$DEST/*.whl" >/dev/null; then
    log "wheelhouse already filled for these requirements (.stamp matches); use --refresh to download again"
else
    # Transitive dependencies' markers are evaluated by pip against this host.
    host="$("$PYTHON" -c 'import platform, sys; print(platform.machine(), "%d.%d" % sys.version_info[:2])')"
    if [[ "$host" != "$ARCH $PY_VERSION" ]]; then
        log "warning: this host is '$host', not '$ARCH $PY_VERSION': markers of indirect dependencies are judged for the host"
    fi
    rm -f "$DEST/.stamp"
    run "${download[@]}"
    printf '%s\n' "$stamp" >"$DEST/.stamp"
fi

count="$(compgen -G "$DEST/*.whl" | wc -l)"
log "done in $((SECONDS - start)) s: ${count} wheels, $(du -sh "$DEST" | cut -f1) in $DEST"
