#!/usr/bin/env bash
# slurm-cluster.sh: a Slurm cluster of containers on one Docker host, for the multi-node tests.
#
# Why: the project's machines have no Slurm cluster, but Docker and Debian's archive. A node is a
# container: `slurmctl` runs slurmctld, `node1`..`nodeN` run slurmd (slurm-wlm 22.05 and munge from
# Debian, installed in an image derived from the asyncps image), all on one Docker network, with
# one munge key (made once per cluster, never baked into the image) and one shared volume mounted
# at /shared in every node: the run directory's "shared storage", as on a real cluster.
#
# Unprivileged: proctrack/linuxproc and task/none (no cgroups); SlurmdParameters=config_overrides
# lets each node declare CPUs=4 on a 2-core host, so a node can hold a chief and two shards. A lost
# node is noticed within about 30 s (SlurmdTimeout=10), a requeued job waits 10 s before it starts again
# (AuthInfo=cred_expire=10; Slurm's default, 120 s, is the credential lifetime), and the scheduler looks
# for work every 5 s (sched_interval, bf_interval: 60 s and 30 s by default, a requeued job's longest wait);
# tasks a lost node's job leaves on the others get SIGKILL 5 s after SIGTERM (KillWait, 30 s by default).
#
#   scripts/slurm-cluster.sh build      # the image (asyncps-slurm:test), once; ~2 min
#   scripts/slurm-cluster.sh up         # network, volume, munge key, slurmctld, slurmd x N; waits idle
#   scripts/slurm-cluster.sh exec CMD   # run CMD on the controller in /shared (sbatch, squeue...)
#   scripts/slurm-cluster.sh down       # remove containers, network and volumes
#
# --src DIR mounts that source tree read-only at /src and puts it first on every task's Python path
# (as the installed layout: asyncps.chief is chief/...; the tests run the working tree's asyncps
# in the image's environment).
set -euo pipefail

BASE="${ASYNCPS_SLURM_BASE:-asyncps:test}"
IMAGE="${ASYNCPS_SLURM_IMAGE:-asyncps-slurm:test}"
PREFIX="${ASYNCPS_SLURM_PREFIX:-asyncps-slurm}"
NODES="${ASYNCPS_SLURM_NODES:-2}"
SRC=""

usage() {
    sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'
    cat <<EOF
Options (before the command): --base IMAGE (default ${BASE}), --image TAG (default ${IMAGE}),
--prefix NAME (containers, network, volumes; default ${PREFIX}), --nodes N (default ${NODES}),
--src DIR (see above). Environment: ASYNCPS_SLURM_BASE, _IMAGE, _PREFIX, _NODES.
EOF
}

log() { printf '[slurm-cluster] %s\n' "$*" >&2; }
die() { printf '[slurm-cluster] error: %s\n' "$*" >&2; exit 1; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        --base) BASE="${2:?--base needs a value}"; shift 2 ;;
        --image) IMAGE="${2:?--image needs a value}"; shift 2 ;;
        --prefix) PREFIX="${2:?--prefix needs a value}"; shift 2 ;;
        --nodes) NODES="${2:?--nodes needs a value}"; shift 2 ;;
        --src) SRC="$(cd "${2:?--src needs a value}" && pwd)"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) break ;;
    esac
done
COMMAND="${1:-}"
[[ -n "$COMMAND" ]] || { usage >&2; exit 2; }
shift
NET="${PREFIX}-net"
ETC="${PREFIX}-etc"       # slurm.conf and the munge key, read by every node at start
SHARED="${PREFIX}-shared" # /shared in every node: run directories
NODE_LIST="node[1-${NODES}]"

build() {
    docker image inspect "$BASE" >/dev/null 2>&1 \
        || die "no base image $BASE: build it first (tests/dockerutil.py builds asyncps:test; or --base)"
    log "building $IMAGE from $BASE (slurm-wlm, munge from Debian's archive)"
    docker build -t "$IMAGE" --build-arg "BASE=$BASE" - <<'EOF'
ARG BASE
FROM ${BASE}
USER root
RUN apt-get update -q \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        slurm-wlm munge procps \
    && rm -rf /var/lib/apt/lists/* /etc/munge/munge.key \
    && mkdir -p /var/spool/slurmctld /var/spool/slurmd /run/munge /shared \
    && chown munge:munge /run/munge
# a node is not one asyncps server: no probe of 127.0.0.1:8470 every 15 s (a Python start each)
HEALTHCHECK NONE
ENTRYPOINT []
CMD ["bash"]
EOF
}

slurm_conf() {
    cat <<EOF
ClusterName=asyncps
SlurmctldHost=slurmctl
AuthType=auth/munge
AuthInfo=cred_expire=10
SlurmUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=5,bf_interval=5
SlurmdParameters=config_overrides
ReturnToService=2
SlurmdTimeout=10
MessageTimeout=5
KillWait=5
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldLogFile=/var/log/slurmctld.log
SlurmdLogFile=/var/log/slurmd.log
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName=${NODE_LIST} CPUs=4 RealMemory=4000 State=UNKNOWN
PartitionName=batch Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

# A node's start: its copy of the key and slurm.conf, munged, then the daemon in the foreground.
NODE_START='set -e
install -o munge -g munge -m 0400 /cluster/munge.key /etc/munge/munge.key
cp /cluster/slurm.conf /etc/slurm/slurm.conf
runuser -u munge -- munged
if [ -d /src/asyncps ]; then  # the installed layout (pyproject package-dir) of the mounted tree, as links
    mkdir -p /opt/src && cp -rs /src/asyncps /opt/src/asyncps
    for role in ps worker chief; do ln -s "/src/$role" "/opt/src/asyncps/$role"; done
fi
exec "$@"'

start_node() {  # NAME DAEMON...
    local name="$1"; shift
    local src=()
    if [[ -n "$SRC" ]]; then
        src=(-v "$SRC:/src:ro" -e PYTHONPATH=/opt/src)
    fi
    # tcp_syn_retries=2: a connection to a node that is gone fails in ~7 s instead of the kernel's ~2 min (a
    # container's address vanishes without an ARP failure, where a LAN answers a dead host's address at once):
    # the surviving node's step otherwise waits that long to tell the lost batch host its tasks ended
    docker run -d --name "${PREFIX}-${name}" --hostname "$name" --network "$NET" --network-alias "$name" \
        --sysctl net.ipv4.tcp_syn_retries=2 -v "$ETC:/cluster:ro" -v "$SHARED:/shared" "${src[@]}" --user root \
        "$IMAGE" bash -c "$NODE_START" node "$@" >/dev/null
}

up() {
    docker image inspect "$IMAGE" >/dev/null 2>&1 || build
    docker network create "$NET" >/dev/null
    docker volume create "$ETC" >/dev/null
    docker volume create "$SHARED" >/dev/null
    log "munge key and slurm.conf for ${NODE_LIST}"
    slurm_conf | docker run --rm -i -v "$ETC:/cluster" --user root "$IMAGE" bash -c \
        'mungekey -c -k /cluster/munge.key -f && cat > /cluster/slurm.conf && chmod 0644 /cluster/slurm.conf'
    start_node slurmctl slurmctld -D
    local i
    for ((i = 1; i <= NODES; i++)); do
        start_node "node$i" slurmd -D
    done
    wait_idle
}

wait_idle() {  # every node idle in sinfo (slurmd registered), within 120 s
    local deadline=$((SECONDS + 120)) state
    while ((SECONDS < deadline)); do
        state="$(docker exec "${PREFIX}-slurmctl" sinfo -h -N -o '%N %t' 2>/dev/null || true)"
        if [[ "$(grep -c ' idle$' <<<"$state")" -eq "$NODES" ]]; then
            log "up: $(tr '\n' ' ' <<<"$state")"
            return 0
        fi
        sleep 1
    done
    die "nodes not idle after 120 s: ${state:-no answer from slurmctld}; see docker logs ${PREFIX}-node1"
}

down() {
    local names
    names="$(docker ps -aq --filter "name=^${PREFIX}-")"
    [[ -z "$names" ]] || docker rm -f $names >/dev/null
    docker network rm "$NET" >/dev/null 2>&1 || true
    docker volume rm "$ETC" "$SHARED" >/dev/null 2>&1 || true
    log "down"
}

case "$COMMAND" in
    build) build ;;
    up) up ;;
    down) down ;;
    exec) docker exec -i -w /shared "${PREFIX}-slurmctl" "$@" ;;
    *) die "unknown command $COMMAND (build, up, exec, down)" ;;
esac
