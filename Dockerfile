# The monitor service image. The service needs no PyTorch, so the image installs the distribution's
# dependencies minus torch, then the package itself without dependency resolution.
FROM python:3.11-slim AS monitor
WORKDIR /app
COPY pyproject.toml README.md ./
RUN python -c "import tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; print('\n'.join(d for d in deps if not d.startswith('torch')))" > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt
COPY fp8_trainer fp8_trainer
COPY kernels kernels
COPY monitor_server monitor_server
COPY web web
RUN pip install --no-cache-dir --no-deps . && useradd --create-home fp8scope
USER fp8scope
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz')"
CMD ["fp8-monitor", "serve", "--host", "0.0.0.0", "--port", "8000"]
