#!/usr/bin/env bash
# netem.sh: add or remove network delay on one container of a running compose project.
#
#   scripts/netem.sh add  PROJECT SERVICE [INDEX] DELAY [JITTER]   # e.g. add asyncps worker 1 50ms 10ms
#   scripts/netem.sh del  PROJECT SERVICE [INDEX]
#   scripts/netem.sh show PROJECT SERVICE [INDEX]
#
# PROJECT is the compose project name (`docker-compose -p NAME`; by default the name of the
# directory holding docker-compose.yml, e.g. `main`), SERVICE a service of docker-compose.yml
# (ps-0, ps-1, chief, worker) and INDEX the replica number (default 1), as in the container name
# PROJECT_SERVICE_INDEX. The delay applies to everything the container sends (its egress on
# eth0), so a delayed worker sees each RPC's round trip grow by DELAY.
#
# The image has no iproute2, so `tc` runs on the Docker host inside the container's network
# namespace (nsenter -t PID -n). Needs root on the Docker host (a local engine), `tc` and
# `nsenter` there, and a kernel with the netem qdisc (CONFIG_NET_SCH_NETEM / sch_netem).
# The qdisc lives in the container's namespace: it goes away when the container stops or
# restarts.
set -euo pipefail

usage() {
    sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

die() { echo "netem.sh: $*" >&2; exit 1; }

[[ $# -ge 3 ]] || usage
action=$1 project=$2 service=$3
shift 3
index=1
if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then
    index=$1
    shift
fi

for tool in docker nsenter tc; do
    command -v "$tool" >/dev/null || die "no '$tool' on this host"
done

container=$(docker ps -q \
    --filter "label=com.docker.compose.project=${project}" \
    --filter "label=com.docker.compose.service=${service}" \
    --filter "label=com.docker.compose.container-number=${index}")
[[ -n $container ]] || die "no running container ${project}_${service}_${index}"
pid=$(docker inspect -f '{{.State.Pid}}' "$container")
[[ $pid =~ ^[1-9][0-9]*$ ]] || die "no process for ${project}_${service}_${index}"

in_ns() { nsenter -t "$pid" -n -- "$@"; }

case $action in
    add)
        [[ $# -ge 1 ]] || usage
        delay=$1 jitter=${2:-}
        # replace: adding twice changes the delay instead of failing.
        if ! err=$(in_ns tc qdisc replace dev eth0 root netem delay "$delay" ${jitter:+"$jitter"} 2>&1); then
            if [[ $err == *"qdisc kind is unknown"* ]]; then
                die "this kernel has no netem qdisc (sch_netem): no delay possible here"
            fi
            die "tc failed: $err"
        fi
        echo "${project}_${service}_${index}: delay ${delay}${jitter:+ ± ${jitter}} on eth0"
        ;;
    del)
        # Deleting the root qdisc restores the default; "nothing to delete" is not an error.
        if ! err=$(in_ns tc qdisc del dev eth0 root 2>&1); then
            [[ $err == *"Cannot delete qdisc with handle of zero"* || $err == *"No such file"* ]] \
                || die "tc failed: $err"
        fi
        echo "${project}_${service}_${index}: no delay on eth0"
        ;;
    show)
        in_ns tc qdisc show dev eth0
        ;;
    *)
        usage
        ;;
esac
