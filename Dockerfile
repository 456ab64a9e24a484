# kvstream image: the `kvstream` command (stream-app worker, simulator, query client).
# Used by docker-compose.yml; Kafka itself runs from the official apache/kafka image.
# The embedded broker (`kvstream broker`) is not usable here: the image has no Java or Maven.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
# pyproject.toml names README.md as the package's readme, so the build needs it.
COPY pyproject.toml README.md ./
COPY schemas/ schemas/
COPY kafka_io/ kafka_io/
COPY producers/ producers/
COPY stream_apps/ stream_apps/
COPY kvstream/ kvstream/
RUN pip install '.' \
    && useradd --system --uid 10001 --home-dir /data --shell /usr/sbin/nologin kvstream \
    && mkdir -p /data \
    && chown kvstream /data

# /data is the worker's state directory (--data-dir /data). It is created here, owned by the
# kvstream user, so a volume mounted on it starts with that ownership.
USER kvstream
WORKDIR /data

ENTRYPOINT ["kvstream"]
CMD ["--help"]
