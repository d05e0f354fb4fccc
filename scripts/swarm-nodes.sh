#!/usr/bin/env bash
# swarm-nodes.sh: a multi-node Docker Swarm of containers on one Docker host, for the multi-node tests.
#
# Why: the project's machines have one Docker engine, no registry and no second host. A node is a
# container that runs its own dockerd (Debian's docker.io, in an image derived from asyncps-base),
# all nodes on one user-defined Docker network: `mgr` inits the swarm (the manager), `w1`..`wN` join
# it as swarm workers. The stack's overlay network then carries tasks' traffic between the nodes as
# VXLAN (UDP 4789) over that bridge network, as between hosts. There is no registry: images are copied
# into a node's engine with `docker save | docker exec -i NODE docker load` (`load`), only where needed.
# Labels place the stack (deploy/stack.yml): the manager gets asyncps.role=ps (shards and the chief),
# the workers asyncps.role=worker (workers only).
#
#   scripts/swarm-nodes.sh build                    # the node image (asyncps-mn-node:test), once; ~1 min
#   scripts/swarm-nodes.sh start                    # network, volumes, nodes, swarm, labels; waits Ready
#   scripts/swarm-nodes.sh load IMAGE NODE...       # copy a local image into nodes (mgr, w1, ...)
#   scripts/swarm-nodes.sh exec NODE CMD...         # run CMD in a node (docker stack deploy on mgr...)
#   scripts/swarm-nodes.sh status                   # the swarm's nodes as the manager lists them
#   scripts/swarm-nodes.sh stop                     # remove the nodes, their network and volumes
#
# A node is killed like a host that dies: `docker kill PREFIX-w2` (its dockerd is the container's
# init: the kernel kills every process of its PID namespace, its tasks' too).
set -euo pipefail

BASE="${ASYNCPS_SWARM_BASE:-asyncps-base:bookworm}"
IMAGE="${ASYNCPS_SWARM_IMAGE:-asyncps-mn-node:test}"
PREFIX="${ASYNCPS_SWARM_PREFIX:-asyncps-mn}"
WORKERS="${ASYNCPS_SWARM_WORKERS:-2}"

usage() {
    sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'
    cat <<EOF
Options (before the command): --base IMAGE (default ${BASE}), --image TAG (default ${IMAGE}),
--prefix NAME (containers, network, volumes; default ${PREFIX}), --workers N (swarm workers beside
the manager; default ${WORKERS}). Environment: ASYNCPS_SWARM_BASE, _IMAGE, _PREFIX, _WORKERS.
EOF
}

log() { printf '[swarm-nodes] %s\n' "$*" >&2; }
die() { printf '[swarm-nodes] error: %s\n' "$*" >&2; exit 1; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        --base) BASE="${2:?--base needs a value}"; shift 2 ;;
        --image) IMAGE="${2:?--image needs a value}"; shift 2 ;;
        --prefix) PREFIX="${2:?--prefix needs a value}"; shift 2 ;;
        --workers) WORKERS="${2:?--workers needs a value}"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) break ;;
    esac
done
COMMAND="${1:-}"
[[ -n "$COMMAND" ]] || { usage >&2; exit 2; }
shift
NET="${PREFIX}-net"

nodes() {  # mgr w1 .. wN
    local i
    printf 'mgr'
    for ((i = 1; i <= WORKERS; i++)); do printf ' w%d' "$i"; done
    printf '\n'
}

build() {
    docker image inspect "$BASE" >/dev/null 2>&1 \
        || die "no base image $BASE: scripts/docker-base.sh builds asyncps-base:bookworm (or --base)"
    log "building $IMAGE from $BASE (docker.io, iptables from Debian's archive)"
    docker build -t "$IMAGE" --build-arg "BASE=$BASE" - <<'EOF'
ARG BASE
FROM ${BASE}
USER root
# docker.io: dockerd, containerd, runc and the CLI (20.10, as the host's); iptables: dockerd's NAT and
# the overlay's rules; iproute2: `ip` to inspect a node's vxlan links
RUN apt-get update -q \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        docker.io iptables iproute2 procps ca-certificates \
    && rm -rf /var/lib/apt/lists/*
HEALTHCHECK NONE
ENTRYPOINT []
CMD ["bash"]
EOF
}

start_node() {  # NAME
    local name="$1"
    docker volume create --label "asyncps.swarm-nodes=${PREFIX}" "${PREFIX}-${name}-lib" >/dev/null
    # `--privileged` is refused on the project's machines (SYS_RESOURCE cannot be granted); what a dockerd
    # needs, granted one by one:
    #   SYS_ADMIN         mounts (overlay2 layers, /proc and /sys of its containers, secrets' tmpfs), namespaces
    #   NET_ADMIN         bridges, veths, the vxlan links of the overlay, iptables rules, sysctls of new netns
    #   NET_RAW           iptables and raw sockets (ARP/ICMP) in its networks
    #   MKNOD             device nodes of its containers' /dev
    #   SYS_PTRACE        `docker exec` and health checks: runc opens /proc/PID/ns/* of a task's process, whose
    #                     user (asyncps, uid 10001) is not root's: without it "error executing setns process"
    #   seccomp/apparmor unconfined: the default profiles refuse mount(2), unshare(2), setns(2) and
    #                     keyctl(2) that runc needs even with the capabilities
    #   --cgroupns host and /sys/fs/cgroup read-write: its containers' cgroups (the host's hierarchy,
    #                     under --cgroup-parent PREFIX-NAME so they are apart from the host engine's)
    #   /var/lib/docker on a volume: overlay2 cannot stack on the container's own overlay root; on the volume
    #                     (the host's filesystem) it can, and images are not copied per layer as with vfs
    docker run -d --name "${PREFIX}-${name}" --hostname "$name" --network "$NET" --network-alias "$name" \
        --cap-add SYS_ADMIN --cap-add NET_ADMIN --cap-add NET_RAW --cap-add MKNOD --cap-add SYS_PTRACE \
        --security-opt seccomp=unconfined --security-opt apparmor=unconfined \
        --cgroupns host -v /sys/fs/cgroup:/sys/fs/cgroup:rw \
        -v "${PREFIX}-${name}-lib:/var/lib/docker" \
        --label "asyncps.swarm-nodes=${PREFIX}" \
        "$IMAGE" dockerd --storage-driver overlay2 --cgroup-parent "/${PREFIX}-${name}" --log-level warn \
        >/dev/null
}

wait_engine() {  # NAME: its dockerd answers, within 60 s
    local deadline=$((SECONDS + 60))
    while ((SECONDS < deadline)); do
        docker exec "${PREFIX}-$1" docker info --format '{{.ServerVersion}}' >/dev/null 2>&1 && return 0
        sleep 1
    done
    docker logs --tail 20 "${PREFIX}-$1" >&2 || true
    die "the dockerd of node $1 did not answer within 60 s"
}

start() {
    docker image inspect "$IMAGE" >/dev/null 2>&1 || build
    docker network create --label "asyncps.swarm-nodes=${PREFIX}" "$NET" >/dev/null
    local name
    for name in $(nodes); do start_node "$name"; done
    for name in $(nodes); do wait_engine "$name"; done
    local addr token
    addr="$(docker inspect -f "{{(index .NetworkSettings.Networks \"$NET\").IPAddress}}" "${PREFIX}-mgr")"
    # --advertise-addr: the address on the nodes' network (a node has one interface, but say it);
    # heartbeats every 2 s (5 s by default): a killed node is Down within ~6 s and its tasks rescheduled
    docker exec "${PREFIX}-mgr" docker swarm init --advertise-addr "$addr" --dispatcher-heartbeat 2s >/dev/null
    token="$(docker exec "${PREFIX}-mgr" docker swarm join-token -q worker)"
    for name in $(nodes); do
        [[ "$name" == mgr ]] && continue
        docker exec "${PREFIX}-${name}" docker swarm join --token "$token" "${addr}:2377" >/dev/null
    done
    wait_ready
    docker exec "${PREFIX}-mgr" docker node update --label-add asyncps.role=ps mgr >/dev/null
    for name in $(nodes); do
        [[ "$name" == mgr ]] && continue
        docker exec "${PREFIX}-mgr" docker node update --label-add asyncps.role=worker "$name" >/dev/null
    done
    log "up: $(docker exec "${PREFIX}-mgr" docker node ls --format '{{.Hostname}}:{{.Status}}' | tr '\n' ' ')"
}

wait_ready() {  # every node Ready in `docker node ls`, within 60 s
    local deadline=$((SECONDS + 60)) want state
    want="$(nodes | wc -w)"
    while ((SECONDS < deadline)); do
        state="$(docker exec "${PREFIX}-mgr" docker node ls --format '{{.Hostname}} {{.Status}}' 2>/dev/null || true)"
        if [[ "$(grep -c ' Ready$' <<<"$state")" -eq "$want" ]]; then
            return 0
        fi
        sleep 1
    done
    die "not every node Ready after 60 s: ${state:-no answer from the manager}"
}

load() {  # IMAGE NODE...: copied in parallel
    local image="${1:?load needs IMAGE NODE...}" node pids=()
    shift
    [[ $# -gt 0 ]] || die "load needs IMAGE NODE..."
    for node in "$@"; do
        (docker save "$image" | docker exec -i "${PREFIX}-${node}" docker load -q >/dev/null) &
        pids+=($!)
    done
    local failed=0 pid
    for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
    ((failed == 0)) || die "loading $image into $* failed"
    log "loaded $image into $*"
}

stop() {
    local names
    names="$(docker ps -aq --filter "label=asyncps.swarm-nodes=${PREFIX}")"
    [[ -z "$names" ]] || docker rm -f -v $names >/dev/null
    docker network rm "$NET" >/dev/null 2>&1 || true
    local vols  # each node's /var/lib/docker (its images and containers)
    vols="$(docker volume ls -q --filter "label=asyncps.swarm-nodes=${PREFIX}")"
    [[ -z "$vols" ]] || docker volume rm $vols >/dev/null 2>&1 || true
    # the cgroups the nodes' engines made in the host's hierarchy (empty once their processes are gone)
    if docker image inspect "$IMAGE" >/dev/null 2>&1; then
        docker run --rm --cgroupns host -v /sys/fs/cgroup:/sys/fs/cgroup:rw --user root "$IMAGE" \
            sh -c "for d in /sys/fs/cgroup/*/${PREFIX}-*; do [ -d \"\$d\" ] && find \"\$d\" -depth -type d -exec rmdir {} \\; ; done; true" \
            || true
    fi
    log "stopped"
}

status() {
    docker ps -a --filter "label=asyncps.swarm-nodes=${PREFIX}" --format '{{.Names}} {{.Status}}'
    docker exec "${PREFIX}-mgr" docker node ls --format \
        '{{.Hostname}} {{.Status}} {{.Availability}} {{.ManagerStatus}}' 2>/dev/null || true
}

case "$COMMAND" in
    build) build ;;
    start) start ;;
    load) load "$@" ;;
    exec) node="${1:?exec needs NODE CMD...}"; shift; docker exec -i "${PREFIX}-${node}" "$@" ;;
    status) status ;;
    stop) stop ;;
    *) die "unknown command $COMMAND (build, start, load, exec, status, stop)" ;;
esac
