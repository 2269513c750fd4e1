# syntax=docker/dockerfile:1.7
# One image per role, each a build target:
#   docker build --target agent    -t ghcr.io/loraplex/loraplex-agent:0.1.0 .     (CUDA torch, the engine)
#   docker build --target router   -t ghcr.io/loraplex/loraplex-router:0.1.0 .    (slim: no torch)
#   docker build --target operator -t ghcr.io/loraplex/loraplex-operator:0.1.0 .  (slim: no torch)
# The sources become a wheel in the build stage; the role images install it and run as a non-root
# user from a working directory outside site-packages.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN groupadd --system --gid 10001 loraplex \
 && useradd --system --uid 10001 --gid loraplex --create-home --home-dir /home/loraplex loraplex

FROM base AS build
WORKDIR /build
COPY pyproject.toml ./
COPY loraplex ./loraplex
COPY node_agent ./node_agent
COPY router ./router
COPY operator ./operator
COPY kernels ./kernels
RUN pip wheel --no-deps --wheel-dir /wheels .

FROM base AS operator
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install "loraplex[operator] @ file://$(ls /wheels/loraplex-*.whl)"
USER 10001
WORKDIR /home/loraplex
EXPOSE 8080
ENTRYPOINT ["loraplex"]
CMD ["operator"]

FROM base AS router
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install "loraplex[router] @ file://$(ls /wheels/loraplex-*.whl)"
USER 10001
WORKDIR /home/loraplex
EXPOSE 8080
ENTRYPOINT ["loraplex"]
CMD ["router", "--host", "0.0.0.0", "--port", "8080"]

FROM base AS agent
# CUDA builds of torch carry their CUDA runtime as pip packages, so a slim Python base suffices.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu124
ARG TORCH_VERSION=2.5.1
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install "loraplex[agent,kernels] @ file://$(ls /wheels/loraplex-*.whl)"
USER 10001
WORKDIR /home/loraplex
EXPOSE 8000
ENTRYPOINT ["loraplex"]
CMD ["agent", "--help"]
