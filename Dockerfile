# One Dockerfile, one image per role, each a build target (scripts/build-images.sh builds them all):
#   router     slim: no torch                     loraplex-router:<version>
#   operator   slim: no torch                     loraplex-operator:<version>
#   agent      the engine on CUDA (torch + Triton) loraplex-agent:<version>
#   agent-cpu  the engine on CPU (torch CPU build) loraplex-agent-cpu:<version>
# The sources become a wheel in the build stage; the role images install it with the extras they
# need (a plain COPY of the wheel: no BuildKit-only syntax, so docker and buildah both build it) and
# run as a non-root user (uid 10001) from a working directory outside site-packages.
# Every build argument below can be overridden, e.g. PYTHON_IMAGE for a registry mirror or an
# air-gapped stand-in, TORCH_INDEX_URL for a local package mirror.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN groupadd --system --gid 10001 loraplex \
 && useradd --system --uid 10001 --gid loraplex --create-home --home-dir /home/loraplex loraplex
# install-loraplex EXTRAS: installs the build stage's wheel with those extras, and fails loudly
# when the wheel is missing (a glob that matches nothing would otherwise reach pip as a literal).
RUN printf '%s\n' '#!/bin/sh' 'set -eu' 'set -- /wheels/loraplex-*.whl "$@"' \
      '[ -f "$1" ] || { echo "install-loraplex: no loraplex wheel in /wheels" >&2; exit 1; }' \
      'pip install "loraplex[$2] @ file://$1"' > /usr/local/bin/install-loraplex \
 && chmod 755 /usr/local/bin/install-loraplex

FROM base AS build
WORKDIR /build
COPY pyproject.toml ./
COPY loraplex ./loraplex
COPY node_agent ./node_agent
COPY router ./router
COPY local ./local
COPY operator ./operator
COPY kernels ./kernels
RUN pip wheel --no-deps --wheel-dir /wheels . && ls /wheels/loraplex-*.whl

FROM base AS operator
COPY --from=build /wheels /wheels
RUN install-loraplex operator && rm -rf /wheels
USER 10001
WORKDIR /home/loraplex
EXPOSE 8080
ENTRYPOINT ["loraplex"]
CMD ["operator"]

FROM base AS router
COPY --from=build /wheels /wheels
RUN install-loraplex router && rm -rf /wheels
USER 10001
WORKDIR /home/loraplex
EXPOSE 8080
ENTRYPOINT ["loraplex"]
CMD ["router", "--host", "0.0.0.0", "--port", "8080"]

# The engine's images share this stage: a C/C++ compiler, which Triton needs the first time it
# launches a kernel and the fused CPU LoRA kernel needs the first time an agent starts on a CPU.
FROM base AS agent-base
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc g++ libc6-dev \
 && rm -rf /var/lib/apt/lists/*

# CUDA: PyPI's torch is the CUDA build and carries its CUDA runtime as pip packages. Triton is
# pinned to the version the kernels are tested with (its interpreter runs them in CI) in place of
# the one torch asks for (the engine does not use torch.compile, the only user of torch's pin). It
# goes in last, with --no-deps, since any later install would put torch's pin back.
FROM agent-base AS agent
ARG TORCH_VERSION=2.13.0
ARG TRITON_VERSION=3.6.0
RUN pip install "torch==${TORCH_VERSION}"
COPY --from=build /wheels /wheels
RUN install-loraplex agent,kernels && rm -rf /wheels \
 && pip install --no-deps "triton==${TRITON_VERSION}" \
 && python -c "import torch, triton; assert triton.__version__ == '${TRITON_VERSION}', triton.__version__; \
print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'triton', triton.__version__)"
USER 10001
WORKDIR /home/loraplex
EXPOSE 8000
ENTRYPOINT ["loraplex"]
CMD ["agent", "--help"]

# CPU: torch's CPU build from its own index (a local version such as 2.13.0+cpu sorts above PyPI's
# CUDA build of the same release, so pip takes it).
FROM agent-base AS agent-cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# A mirror of that index served over plain http names its host here (pip reads the variable).
ARG PIP_TRUSTED_HOST=""
RUN pip install --extra-index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
 && python -c "import torch; assert not torch.version.cuda, 'a CUDA build of torch'; print('torch', torch.__version__)"
COPY --from=build /wheels /wheels
RUN install-loraplex agent,kernels && rm -rf /wheels
USER 10001
WORKDIR /home/loraplex
EXPOSE 8000
ENTRYPOINT ["loraplex"]
CMD ["agent", "--help"]
