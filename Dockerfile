# Two images. The last stage (the default target) is the monitor service; `trainer` is an example FP8
# training job for docker-compose.yml.

# An example training job: the CPU build of PyTorch and the whole distribution (fp8-train). A C compiler
# too: the fused CPU quantize kernel (fp8_kernels/cpu/fused.c) is compiled for the machine at the first step;
# without one the job runs the slower reference kernels and says so.
FROM python:3.11-slim AS trainer
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml setup.py README.md ./
COPY fp8_trainer fp8_trainer
COPY fp8_kernels fp8_kernels
COPY fp8_protocol fp8_protocol
COPY monitor_server monitor_server
COPY web web
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
    && pip install --no-cache-dir . && useradd --create-home fp8scope
USER fp8scope
WORKDIR /home/fp8scope
CMD ["fp8-train", "--preset", "tiny", "--steps", "1000", "--no-progress"]

# The monitor service. The service needs no PyTorch, so the image installs the dependencies of the
# "server" extra (torch is not among them), then the package itself without dependency resolution.
FROM python:3.11-slim AS monitor
WORKDIR /app
COPY pyproject.toml setup.py README.md ./
RUN python -c "import tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['server']; print('\n'.join(d for d in deps if not d.startswith('torch')))" > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt
COPY fp8_trainer fp8_trainer
COPY fp8_kernels fp8_kernels
COPY fp8_protocol fp8_protocol
COPY monitor_server monitor_server
COPY web web
RUN pip install --no-cache-dir --no-deps . && useradd --create-home fp8scope
USER fp8scope
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz')"
CMD ["fp8-monitor", "serve", "--host", "0.0.0.0", "--port", "8000"]
