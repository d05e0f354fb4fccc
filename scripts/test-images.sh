#!/usr/bin/env bash
# Build the images the docker tests use (tests/dockerutil.py: build_image makes the same, with these tags),
# so that .ci/run can build them while `make test` runs: the build waits mostly on the network and the
# disk. The tests' own build then finds every layer cached (seconds). Usage: scripts/test-images.sh
set -euo pipefail
cd "$(dirname "$0")/.."
base="${ASYNCPS_BASE_IMAGE:-asyncps-base:bookworm}"
if [ "$base" = "asyncps-base:bookworm" ]; then
  scripts/docker-base.sh --tag "$base"
fi
scripts/wheelhouse.sh
docker build --build-arg BASE_IMAGE="$base" -t asyncps:test .
docker build --build-arg BASE_IMAGE="$base" --target shard -t asyncps-shard:test .
