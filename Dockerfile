# One image for every asyncps role: parameter server, chief and worker.
#   asyncps ps --port 8470 --chief chief:8470
#   asyncps chief --port 8470 --ps ps-0:8470,ps-1:8470 --num-workers 2 --run-dir /runs/NAME
#   asyncps worker --chief chief:8470
#
# Build (our machines have no image registry, so make the base and the wheels first):
#   scripts/docker-base.sh      # local asyncps-base:bookworm from Debian packages
#   scripts/wheelhouse.sh       # .wheelhouse/: linux x86_64 cp311 wheels
#   docker build --build-arg BASE_IMAGE=asyncps-base:bookworm -t asyncps:dev .
# Anywhere with Docker Hub and a package index, a plain `docker build -t asyncps .`
# works too: python:3.11-slim base and, without .wheelhouse/, wheels from the index.
#
# Stages (plain Dockerfile syntax, so the classic builder of Docker 20.10 works):
#   base  - the base image plus the runtime settings and the asyncps user
#   deps  - a venv at /opt/asyncps with the third-party dependencies; its only
#           inputs are pyproject.toml and .wheelhouse/*.whl, so code changes
#           don't rebuild it
#   wheel - builds the project wheel from the source in the build context and
#           installs it (--no-deps) under /install, laid out like the venv
#   shard-deps - a venv with only what a shard imports (numpy, grpcio,
#           protobuf: pyproject.toml's first three
#           dependencies, with their floors)
#   shard - base + shard-deps + /install: the slim image of the ps-* services
#           (`docker build --target shard -t asyncps-shard:dev .`); shards
#           never import TensorFlow (tests/test_layers.py checks it). It comes
#           before deps, so the classic builder (which builds every stage up to
#           the target) never installs TensorFlow for it
#   final - base + the deps venv + /install; the wheels never reach a layer of
#           the final image. Its metadata comes first and its only steps after
#           the big venv layer are COPYs: the classic builder commits every
#           step, which costs tens of seconds on top of a 1.6 GB layer with
#           fuse-overlayfs storage. It is the last stage, so a plain build
#           without --target builds it.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS base
ARG ASYNCPS_UID=10001
# TF: several roles share a few cores, so one thread per TF/OpenMP/BLAS pool
# unless told otherwise (override per service). glibc malloc: keep large tensor
# buffers in the heap instead of an mmap/munmap per RPC, and don't give memory
# back to the OS after every free. Both sets equal asyncps/procenv.py
# (thread_env(1), MALLOC_ENV); tests/test_procenv.py checks that they do.
# ASYNCPS_HOST: outside a container the roles bind 127.0.0.1 unless told
# otherwise; in one, loopback is the container's own and nobody could reach
# the shard or the chief, so these images listen on every interface (give the
# cluster a token or mTLS: a server without either warns at start).
ENV VIRTUAL_ENV=/opt/asyncps \
    ASYNCPS_HOST=0.0.0.0 \
    PATH=/opt/asyncps/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TF_NUM_INTRAOP_THREADS=1 \
    TF_NUM_INTEROP_THREADS=1 \
    OMP_NUM_THREADS=1 \
    OPENBLAS_NUM_THREADS=1 \
    TF_CPP_MIN_LOG_LEVEL=1 \
    MALLOC_MMAP_THRESHOLD_=268435456 \
    MALLOC_TRIM_THRESHOLD_=536870912 \
    MALLOC_TOP_PAD_=67108864
RUN useradd --uid "${ASYNCPS_UID}" --user-group --no-log-init --create-home \
        --home-dir /home/asyncps --shell /usr/sbin/nologin asyncps \
    && mkdir -p /runs /checkpoints \
    && chown asyncps:asyncps /runs /checkpoints

# --- shard-deps ------------------------------------------------------------
# The shard's requirements are read from pyproject.toml by name, so their
# version floors stay written in one place.
FROM base AS shard-deps
COPY pyproject.toml .wheelhouse/*.whl /tmp/wheelhouse/
RUN set -eu; \
    python3 -m venv /opt/asyncps; \
    if ls /tmp/wheelhouse/*.whl >/dev/null 2>&1; then \
        set -- --no-index --find-links /tmp/wheelhouse; \
    else \
        set --; \
    fi; \
    /opt/asyncps/bin/python -c 'import re, tomllib; deps = tomllib.load(open("/tmp/wheelhouse/pyproject.toml", "rb"))["project"]["dependencies"]; print("\n".join(d for d in deps if re.match(r"(numpy|grpcio|protobuf)\b", d)))' \
        > /tmp/requirements.txt; \
    cat /tmp/requirements.txt; \
    /opt/asyncps/bin/pip install "$@" --requirement /tmp/requirements.txt; \
    /opt/asyncps/bin/pip check

# --- wheel -----------------------------------------------------------------
# A venv at the same path as the real one, so the `asyncps` script that pip
# writes under /install starts with #!/opt/asyncps/bin/python.
FROM base AS wheel
# Only what the wheel is built from, so edits to tests, docs or compose files do not rebuild it;
# the build backend's wheels come from the wheelhouse when there is one (pyproject.toml always
# matches, so the COPY never fails without a wheelhouse).
COPY pyproject.toml .wheelhouse/setuptools-*.whl .wheelhouse/wheel-*.whl .wheelhouse/packaging-*.whl /src/.wheelhouse/
COPY pyproject.toml README.md LICENSE /src/
COPY asyncps /src/asyncps
COPY ps /src/ps
COPY worker /src/worker
COPY chief /src/chief
RUN set -eu; \
    python3 -m venv /opt/asyncps; \
    if ls /src/.wheelhouse/*.whl >/dev/null 2>&1; then \
        set -- --no-index --find-links /src/.wheelhouse; \
    else \
        set --; \
    fi; \
    /opt/asyncps/bin/pip wheel "$@" --no-deps --wheel-dir /dist /src; \
    /opt/asyncps/bin/pip install --no-index --no-deps --no-warn-script-location \
        --prefix /install /dist/*.whl

# --- shard -----------------------------------------------------------------
FROM base AS shard
USER asyncps
WORKDIR /home/asyncps
EXPOSE 8470
HEALTHCHECK --interval=15s --timeout=10s --start-period=30s --retries=3 \
    CMD asyncps health 127.0.0.1:${ASYNCPS_PORT:-8470}
ENTRYPOINT ["asyncps"]
CMD ["ps"]
COPY --from=shard-deps /opt/asyncps /opt/asyncps
COPY --from=wheel /install/ /opt/asyncps/

# --- deps ------------------------------------------------------------------
FROM base AS deps
# The wheelhouse is optional. pyproject.toml always matches, so this COPY never
# fails for want of sources, and the wildcard adds the wheels only when
# scripts/wheelhouse.sh has filled .wheelhouse/ (a wildcard that matches
# nothing is allowed beside a source that exists). A plain `COPY .wheelhouse/`
# would fail without it. The dependency list is read from pyproject.toml, and
# pip judges its markers for this image's platform. TensorFlow is the CPU build
# (the `cpu` extra); the project itself comes later, without dependencies.
# tensorflow/include holds C++ headers for building custom ops (~290 MB), not
# needed to run.
COPY pyproject.toml .wheelhouse/*.whl /tmp/wheelhouse/
RUN set -eu; \
    python3 -m venv /opt/asyncps; \
    if ls /tmp/wheelhouse/*.whl >/dev/null 2>&1; then \
        echo "deps: installing from the wheelhouse (.wheelhouse/, no index)"; \
        set -- --no-index --find-links /tmp/wheelhouse; \
    else \
        echo "deps: no .wheelhouse/ in the build context: installing from the package index"; \
        set --; \
    fi; \
    /opt/asyncps/bin/python -c 'import tomllib; p = tomllib.load(open("/tmp/wheelhouse/pyproject.toml", "rb"))["project"]; print("\n".join(p["dependencies"] + p["optional-dependencies"]["cpu"]))' \
        > /tmp/requirements.txt; \
    /opt/asyncps/bin/pip install "$@" --requirement /tmp/requirements.txt || { \
        echo "deps: pip failed; if pyproject.toml's dependencies changed, run scripts/wheelhouse.sh again" >&2; \
        exit 1; }; \
    /opt/asyncps/bin/pip check; \
    rm -rf /opt/asyncps/lib/python3*/site-packages/tensorflow/include

# --- final -----------------------------------------------------------------
FROM base
USER asyncps
WORKDIR /home/asyncps
EXPOSE 8470
HEALTHCHECK --interval=15s --timeout=10s --start-period=60s --retries=3 \
    CMD asyncps health 127.0.0.1:${ASYNCPS_PORT:-8470}
ENTRYPOINT ["asyncps"]
CMD ["--help"]
COPY --from=deps /opt/asyncps /opt/asyncps
COPY --from=wheel /install/ /opt/asyncps/
