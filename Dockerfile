# kvstream image: the `kvstream` command (stream-app worker, bridge, simulator, query client).
# Used by docker-compose.yml and deploy/kubernetes/; Kafka itself runs from the apache/kafka image.
# The embedded broker (`kvstream broker`) is not usable here: the image has no Java or Maven.
#
# Build arguments:
#   BASE_IMAGE     the Python 3.11 base (default python:3.11-slim; any Debian-like image with python and pip
#                  on PATH, e.g. a mirror in your own registry, or the stand-in of `make images-local`).
#   EXTRA_CA_CERT  PEM text of one or more extra CA certificates, for builds behind a TLS-intercepting proxy:
#                  added to the image's trust store before pip runs, and used by pip. Empty: none. CA
#                  certificates are public, so a build argument is fine (it shows in `docker history`):
#                    docker build --build-arg EXTRA_CA_CERT="$(cat corporate-ca.pem)" .
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG EXTRA_CA_CERT=""

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# pip trusts its own CA list (certifi), not the system's: point it at the system bundle once the extra CA is in.
RUN if [ -n "$EXTRA_CA_CERT" ]; then \
        mkdir -p /usr/local/share/ca-certificates \
        && printf '%s\n' "$EXTRA_CA_CERT" > /usr/local/share/ca-certificates/kvstream-extra-ca.crt \
        && if command -v update-ca-certificates >/dev/null; then update-ca-certificates; \
           else cat /usr/local/share/ca-certificates/kvstream-extra-ca.crt >> /etc/ssl/certs/ca-certificates.crt; fi \
        && pip config --global set global.cert /etc/ssl/certs/ca-certificates.crt; \
    fi

WORKDIR /src
# pyproject.toml names README.md as the package's readme, so the build needs it.
COPY pyproject.toml setup.py README.md ./
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
