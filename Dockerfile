# The spikeguard workers' image: detectors, fusion, actuator, monitor.
# Workers never import torch (it is the trainer side's extra, spikeguard[torch]),
# so the image has numpy, scikit-learn, kafka-python, pydantic and
# prometheus-client only: ~300 MB of site-packages on python:3.11-slim, against
# ~4.5 GB with PyPI's CUDA build of torch.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY spikeguard spikeguard
COPY schemas schemas
COPY producers producers
COPY processors processors
COPY actuators actuators
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
# No pip cache, no build tools, no source tree: only the installed wheels.
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels \
    && python -c "import sys, spikeguard.components; assert 'torch' not in sys.modules"
RUN useradd --system --uid 10001 spikeguard
USER spikeguard
# Workers and the monitor serve /metrics on 9400 (--metrics-port in docker-compose.yml);
# the healthcheck asks it, so a wedged process shows as unhealthy.
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9400/metrics', timeout=4)"
ENTRYPOINT []
