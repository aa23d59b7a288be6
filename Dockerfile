# kvd container image: `docker build -t kvd .`
# Build stage: compiles the io_uring helper (kvd.io._uring, needs liburing-dev)
# and installs kvd into a virtual environment; the runtime stage copies it.
FROM python:3.11-slim AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential liburing-dev \
 && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/kvd
ENV PATH=/opt/kvd/bin:$PATH
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY proto ./proto
COPY native ./native
COPY kvd ./kvd
RUN pip install --no-cache-dir . \
 && python -c "import kvd.io._uring" \
 && kvd version

FROM python:3.11-slim
# liburing2: the shared library kvd.io._uring links against.
RUN apt-get update \
 && apt-get install -y --no-install-recommends liburing2 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 kvd \
 && useradd --system --uid 10001 --gid kvd --home-dir /var/lib/kvd --shell /usr/sbin/nologin kvd \
 && mkdir -p /var/lib/kvd /run/kvd /etc/kvd \
 && chown kvd:kvd /var/lib/kvd /run/kvd
COPY --from=build /opt/kvd /opt/kvd
ENV PATH=/opt/kvd/bin:$PATH \
    PYTHONUNBUFFERED=1
USER 10001:10001
# With no config the L2 file lands in ./kvd-data/ here.
WORKDIR /var/lib/kvd
VOLUME ["/var/lib/kvd"]
# gRPC, bulk TCP, Prometheus /metrics.
EXPOSE 7070 7071 9470
# grpc.health.v1 stays open with auth on; kvd health exits 0 on SERVING.
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
  CMD ["kvd", "health", "--target", "127.0.0.1:7070", "--timeout-s", "4"]
# SIGTERM drains within shutdown_grace_ms; give `docker stop -t` more than that.
STOPSIGNAL SIGTERM
ENTRYPOINT ["kvd"]
CMD ["serve"]
