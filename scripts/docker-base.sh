#!/usr/bin/env bash
# docker-base.sh: build the local base image for the asyncps containers.
#
# Why: the Docker engine on our machines (developers' and CI's) has no image
# registry to pull from, so `FROM python:3.11-slim` cannot work there. Debian's
# package archive *is* reachable, so this script makes an equivalent image from
# Debian packages: debootstrap a minimal Debian bookworm root filesystem with
# python3 (3.11, matching the cp311 wheels in .wheelhouse/), python3-venv,
# python3-pip and ca-certificates, then `docker import` it as a local image.
#
# The archive address is read from this machine's own apt sources
# (/etc/apt/sources.list, /etc/apt/sources.list.d/*.list and deb822 *.sources),
# so whichever mirror the machine is configured for is used and no package host
# is written into the repository. --mirror overrides it.
#
# Idempotent: when the tag already exists nothing is built (use --force to
# rebuild). The debootstrap root filesystem is a temporary directory that is
# removed after the import (and on failure). Needs root (or sudo) for
# debootstrap; installs debootstrap with apt-get when it is missing.
#
# Then: docker build --build-arg BASE_IMAGE=asyncps-base:bookworm -t asyncps:dev .
set -euo pipefail

TAG="asyncps-base:bookworm"
SUITE="bookworm"
MIRROR="${ASYNCPS_DEBIAN_MIRROR:-}"
FORCE=0
INCLUDE="python3,python3-venv,python3-pip,ca-certificates"
EXPECT_PY="3.11"

usage() {
    cat <<EOF
Usage: scripts/docker-base.sh [options]

Build the local Docker base image for asyncps from Debian packages
(debootstrap + docker import), since no image registry is reachable.

Options:
  --tag TAG        image tag to create (default: ${TAG})
  --mirror URL     Debian archive to use (default: read from the apt sources of
                   this machine for suite '${SUITE}', component 'main';
                   env ASYNCPS_DEBIAN_MIRROR also overrides)
  --force          rebuild even when the image already exists
  -h, --help       show this help

Environment: TMPDIR  where the temporary root filesystem is made (default /var/tmp)
EOF
}

while [[ $# -gt 0 ]]; do
    case "$1" in
        --tag) TAG="${2:?--tag needs a value}"; shift 2 ;;
        --tag=*) TAG="${1#*=}"; shift ;;
        --mirror) MIRROR="${2:?--mirror needs a value}"; shift 2 ;;
        --mirror=*) MIRROR="${1#*=}"; shift ;;
        --force) FORCE=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "docker-base.sh: unknown argument: $1" >&2; usage >&2; exit 2 ;;
    esac
done

log() { printf '[docker-base] %s\n' "$*" >&2; }
run() { printf '[docker-base] + %s\n' "$*" >&2; "$@"; }
die() { printf '[docker-base] error: %s\n' "$*" >&2; exit 1; }

SUDO=()
if [[ "$(id -u)" -ne 0 ]]; then
    command -v sudo >/dev/null 2>&1 || die "debootstrap needs root (or sudo)"
    SUDO=(sudo)
fi

command -v docker >/dev/null 2>&1 || die "docker is not installed"

# Check that the image starts and has the Python the wheelhouse is built for.
check_image() {
    local version
    version="$(docker run --rm --entrypoint python3 "$TAG" --version)" \
        || die "image $TAG does not run python3"
    log "image $TAG: ${version}"
    [[ "$version" == "Python ${EXPECT_PY}."* ]] \
        || die "image $TAG has ${version}, expected Python ${EXPECT_PY}.x (cp311 wheels)"
}

if [[ "$FORCE" -eq 0 ]] && docker image inspect "$TAG" >/dev/null 2>&1; then
    log "image $TAG already exists; skipping the build (use --force to rebuild)"
    check_image
    exit 0
fi

# Find the Debian archive (and its keyring) in this machine's apt sources.
# Prints "URI<TAB>KEYRING" for the first enabled 'deb' entry that carries
# SUITE with component main; KEYRING may be empty.
find_mirror() {
    python3 - "$SUITE" <<'PY'
import glob, re, sys

suite = sys.argv[1]
found = []  # (uri, keyring)

def usable(uri):
    return re.match(r"^(https?|file)://", uri) is not None

def one_line(path):
    # deb [opt=val ...] URI SUITE COMPONENT...
    for raw in open(path, encoding="utf-8", errors="replace"):
        line = raw.split("#", 1)[0].strip()
        m = re.match(r"^deb\s+(?:\[([^\]]*)\]\s+)?(\S+)\s+(\S+)\s+(.*)$", line)
        if not m:
            continue
        opts, uri, dist, comps = m.group(1) or "", m.group(2), m.group(3), m.group(4).split()
        keyring = ""
        for opt in opts.split():
            if opt.startswith("signed-by="):
                keyring = opt.split("=", 1)[1]
        if dist == suite and "main" in comps and usable(uri):
            found.append((uri, keyring))

def deb822(path):
    text = open(path, encoding="utf-8", errors="replace").read()
    for para in re.split(r"\n\s*\n", text):
        fields, key = {}, None
        for raw in para.splitlines():
            if raw.startswith("#") or not raw.strip():
                continue
            if raw[0] in " \t" and key:          # continuation line
                fields[key] += " " + raw.strip()
                continue
            if ":" in raw:
                key, val = raw.split(":", 1)
                key = key.strip().lower()
                fields[key] = val.strip()
        if fields.get("enabled", "yes").lower() == "no":
            continue
        if "deb" not in fields.get("types", "").split():
            continue
        if suite not in fields.get("suites", "").split():
            continue
        if "main" not in fields.get("components", "").split():
            continue
        keyring = fields.get("signed-by", "")
        if not keyring.startswith("/"):
            keyring = ""                        # inline key block: let debootstrap use its default
        for uri in fields.get("uris", "").split():
            if usable(uri):
                found.append((uri, keyring))

for p in ["/etc/apt/sources.list"] + sorted(glob.glob("/etc/apt/sources.list.d/*.list")):
    try:
        one_line(p)
    except OSError:
        pass
for p in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
    try:
        deb822(p)
    except OSError:
        pass
if found:
    print("%s\t%s" % found[0])
PY
}

KEYRING=""
if [[ -z "$MIRROR" ]]; then
    entry="$(find_mirror)"
    [[ -n "$entry" ]] || die "no 'deb ... ${SUITE} main' entry in /etc/apt/sources.list{,.d/*}; pass --mirror URL"
    MIRROR="${entry%%$'\t'*}"
    KEYRING="${entry#*$'\t'}"
    log "Debian archive from this machine's apt sources: ${MIRROR}"
else
    log "Debian archive given: ${MIRROR}"
fi
if [[ -z "$KEYRING" && -r /usr/share/keyrings/debian-archive-keyring.gpg ]]; then
    KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
fi

if ! command -v debootstrap >/dev/null 2>&1 && [[ ! -x /usr/sbin/debootstrap ]]; then
    log "debootstrap is missing; installing it with apt-get"
    run "${SUDO[@]}" apt-get update -q
    run "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends debootstrap
fi
DEBOOTSTRAP="$(command -v debootstrap || echo /usr/sbin/debootstrap)"

ARCH="$(dpkg --print-architecture 2>/dev/null || echo amd64)"
WORK="$(mktemp -d "${TMPDIR:-/var/tmp}/asyncps-base.XXXXXX")"
ROOTFS="$WORK/rootfs"

cleanup() {
    local m
    # debootstrap mounts /proc and /sys inside the target; never rm -rf through a mount.
    while read -r m; do
        "${SUDO[@]}" umount -l "$m" 2>/dev/null || true
    done < <(awk -v r="$ROOTFS" 'index($2, r) == 1 { print $2 }' /proc/mounts | sort -r)
    if awk -v r="$ROOTFS" 'index($2, r) == 1 { found = 1 } END { exit !found }' /proc/mounts; then
        log "warning: mounts remain under $ROOTFS; not removing $WORK"
        return
    fi
    log "removing the temporary root filesystem $WORK"
    "${SUDO[@]}" rm -rf --one-file-system "$WORK"
}
trap cleanup EXIT

start=$SECONDS
log "debootstrap ${SUITE} (${ARCH}, minbase) with ${INCLUDE} into ${ROOTFS}"
debootstrap_args=(--variant=minbase --arch="$ARCH" --components=main --include="$INCLUDE")
if [[ -n "$KEYRING" && -r "$KEYRING" ]]; then
    debootstrap_args+=(--keyring="$KEYRING")
fi
run "${SUDO[@]}" "$DEBOOTSTRAP" "${debootstrap_args[@]}" "$SUITE" "$ROOTFS" "$MIRROR"

log "trimming the root filesystem (apt caches and lists, host resolv.conf/hostname)"
"${SUDO[@]}" rm -rf --one-file-system \
    "$ROOTFS"/var/cache/apt/archives/*.deb \
    "$ROOTFS"/var/cache/apt/*.bin \
    "$ROOTFS"/var/lib/apt/lists/* \
    "$ROOTFS"/var/log/* \
    "$ROOTFS"/tmp/* \
    "$ROOTFS"/root/.cache
# Docker provides these at run time; don't bake the build host's into the image.
"${SUDO[@]}" rm -f "$ROOTFS/etc/resolv.conf" "$ROOTFS/etc/hostname"
"${SUDO[@]}" touch "$ROOTFS/etc/resolv.conf" "$ROOTFS/etc/hostname"

log "importing the root filesystem as ${TAG}"
"${SUDO[@]}" tar -C "$ROOTFS" --numeric-owner \
    --exclude='./dev/*' --exclude='./proc/*' --exclude='./sys/*' -c . \
    | run docker import \
        --change 'ENV LANG=C.UTF-8' \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["python3"]' \
        --message "asyncps base: debootstrap ${SUITE} minbase + ${INCLUDE}" \
        - "$TAG"

cleanup
trap - EXIT

check_image
size="$(docker image inspect --format '{{.Size}}' "$TAG")"
log "built ${TAG} in $((SECONDS - start)) s; size $((size / 1024 / 1024)) MiB"
