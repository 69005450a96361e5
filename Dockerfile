# The spikeguard workers' image (CPU torch from PyPI; the trainer side is your own image).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY spikeguard spikeguard
COPY schemas schemas
COPY producers producers
COPY processors processors
COPY actuators actuators
RUN pip install --no-cache-dir .
ENTRYPOINT []
