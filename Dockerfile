# syntax=docker/dockerfile:1.7
# memascend image: DeepSpeed ZeRO-Infinity fine-tuning with far less host memory.
# Variants (build arguments in images/<variant>/build.env; `just build-image cpu|cuda`):
#   cpu   Debian + CPU torch==2.13.0
#   cuda  Debian + PyPI's CUDA torch==2.13.0; nvcc from NVIDIA's PyPI wheels in the build stage only
# Run (GPU host provisioned with `just provision HOST`; no --privileged needed):
#   docker run --gpus all --device /dev/nvme0n1p3 --ulimit memlock=-1 memascend:cuda finetune ...
#   swap folder instead of a raw partition: docker run -v /mnt/nvme/swap:/swap ... (--nvme-path defaults to /swap)
ARG BUILD_BASE=docker.io/library/debian:12.12-slim
ARG RUNTIME_BASE=docker.io/library/debian:12.12-slim

# Build scripts live in their own stage and are bind-mounted into RUN steps: never in the image.
FROM scratch AS scripts
COPY images/scripts/ /

FROM ${BUILD_BASE} AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG DS_ACCELERATOR=cpu
ARG DS_BUILD_FLAGS="DS_BUILD_AIO=1 DS_BUILD_CPU_ADAM=1"
ARG TORCH_CUDA_ARCH_LIST=""
ARG CUDA_TOOLKIT_WHEELS=""
ARG MEMASCEND_MARCH=x86-64-v3
ARG PIP_FIND_LINKS=""
ARG PIP_CERT=""
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DS_ACCELERATOR=${DS_ACCELERATOR} \
    TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST} \
    CUDA_TOOLKIT_WHEELS=${CUDA_TOOLKIT_WHEELS} \
    MEMASCEND_MARCH=${MEMASCEND_MARCH} \
    MEMASCEND_PREBUILT_DIR=/opt/memascend/prebuilt \
    CC=gcc \
    CXX=g++
RUN --mount=type=bind,from=scripts,target=/scripts \
    /scripts/install-system.sh build
# Compilers are reached through portable-target wrappers (see cc-wrap.sh).
RUN --mount=type=bind,from=scripts,target=/scripts \
    mkdir -p /opt/cc-wrap && \
    for c in gcc g++ cc c++ x86_64-linux-gnu-gcc x86_64-linux-gnu-g++; do \
      install -m 0755 /scripts/cc-wrap.sh "/opt/cc-wrap/$c"; \
    done
ENV PATH=/opt/cc-wrap:${PATH}
# buildah keys its layer cache on the RUN text, not on what is bind-mounted: build.sh passes
# content hashes of the scripts and of the source tree so that a change rebuilds the layers using it.
ARG PYTHON_SCRIPTS_SHA=""
RUN --mount=type=bind,from=scripts,target=/scripts \
    --mount=type=bind,target=/src,rw \
    /scripts/install-python.sh /src
# A layer of its own: DeepSpeed's ops above take ~25 min on 2 cores and stay cached while memascend's ops change.
ARG SOURCE_SHA=""
# hadolint ignore=DL3059
RUN --mount=type=bind,from=scripts,target=/scripts \
    --mount=type=bind,target=/src,rw \
    /scripts/build-ops.sh /src

FROM ${RUNTIME_BASE} AS runtime
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN --mount=type=bind,from=scripts,target=/scripts \
    /scripts/install-system.sh runtime
COPY --from=build /opt/memascend /opt/memascend
# Swap folder (--nvme-path default): a volume, not the container's writable overlay layer, where
# GiBs of swap files would pile up and O_DIRECT depends on the storage driver. Bind a host folder
# on the NVMe disk there: docker run -v /mnt/nvme/swap:/swap ... (unbound: an anonymous volume).
ENV PATH=/opt/memascend/venv/bin:${PATH} \
    MEMASCEND_PREBUILT_DIR=/opt/memascend/prebuilt \
    MEMASCEND_NVME_PATH=/swap \
    PYTHONUNBUFFERED=1
RUN install -d -m 0775 -o 2300 -g 2300 /swap
VOLUME /swap
# Non-root: the user reaches raw partitions through group memascend (GID 2300, as on the host).
USER 2300:2300
WORKDIR /home/memascend
ARG SMOKE_SHA=""
RUN --mount=type=bind,from=scripts,target=/scripts \
    /scripts/smoke.sh
ENTRYPOINT ["memascend"]
CMD ["--help"]
