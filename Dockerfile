# kvstream image: the `kvstream` command (stream-app worker, bridge, simulator, query client).
# Used by docker-compose.yml and deploy/kubernetes/; Kafka itself runs from the apache/kafka image.
# The embedded broker (`kvstream broker`) is not usable here: the image has no Java or Maven.
#
# Two stages on the same base. `build` installs a C compiler and builds the kvstream wheel with its compiled
# modules (schemas._hotpath, stream_apps.residency._record, stream_apps.index._table; setup.py). The final
# stage installs only that wheel, with no compiler, and the build fails there if the compiled modules do not
# load: setup.py falls back to pure Python silently, and an image must not.
#
# Build arguments:
#   BASE_IMAGE     the Python 3.11 base (default python:3.11-slim; any Debian-like image with python and pip
#                  on PATH, e.g. a mirror in your own registry, or the stand-in of `make images-local`). The
#                  build stage installs gcc (and Python's headers if the base lacks them) with apt-get, so it
#                  needs Debian's packages reachable, unless the base has them already.
#   EXTRA_CA_CERT  PEM text of one or more extra CA certificates, for builds behind a TLS-intercepting proxy:
#                  added to the image's trust store before apt-get and pip run, and used by pip. Empty: none. CA
#                  certificates are public, so a build argument is fine (it shows in `docker history`):
#                    docker build --build-arg EXTRA_CA_CERT="$(cat corporate-ca.pem)" .
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS base

ARG EXTRA_CA_CERT=""

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# pip trusts its own CA list (certifi), not the system's: point it at the system bundle once the extra CA is in.
# In this shared stage, so both apt-get (build) and pip (both stages) trust it.
RUN if [ -n "$EXTRA_CA_CERT" ]; then \
        mkdir -p /usr/local/share/ca-certificates \
        && printf '%s\n' "$EXTRA_CA_CERT" > /usr/local/share/ca-certificates/kvstream-extra-ca.crt \
        && if command -v update-ca-certificates >/dev/null; then update-ca-certificates; \
           else cat /usr/local/share/ca-certificates/kvstream-extra-ca.crt >> /etc/ssl/certs/ca-certificates.crt; fi \
        && pip config --global set global.cert /etc/ssl/certs/ca-certificates.crt; \
    fi

FROM base AS build

# gcc and libc6-dev, unless the base has a compiler; Python's headers too where the base lacks them (the official
# image has them in /usr/local/include, a Debian-packaged Python such as the stand-in does not).
RUN set -eu; \
    packages=""; \
    command -v gcc >/dev/null || packages="gcc libc6-dev"; \
    python -c 'import os, sys, sysconfig; \
sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
        || packages="$packages libpython$(python -c 'import sys; print("%d.%d" % sys.version_info[:2])')-dev"; \
    if [ -n "$packages" ]; then \
        if ! command -v apt-get >/dev/null; then \
            echo "kvstream: the base image has no C compiler and no apt-get to install one ($packages)" >&2; exit 1; \
        fi; \
        apt-get update; \
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $packages; \
        rm -rf /var/lib/apt/lists/*; \
    fi; \
    gcc --version | head -n 1

WORKDIR /src
# pyproject.toml names README.md as the package's readme, so the build needs it.
COPY pyproject.toml setup.py README.md ./
COPY schemas/ schemas/
COPY kafka_io/ kafka_io/
COPY producers/ producers/
COPY stream_apps/ stream_apps/
COPY kvstream/ kvstream/
# A host's editable install leaves its own .c and .so next to the .pyx (they may be in the context): built for
# another Python, or from older sources. Cython and gcc build them again here from the .pyx. setup.py only warns
# when a module does not build, so the wheel is checked for both, and pip's verbose log, kept aside, shows why.
RUN find schemas stream_apps -name '*.so' -delete \
    && rm -f schemas/_hotpath.c stream_apps/residency/_record.c stream_apps/index/_table.c \
    && if ! pip wheel --verbose --no-deps --wheel-dir /wheels . > /tmp/pip-wheel.log 2>&1; then \
           tail -n 60 /tmp/pip-wheel.log; exit 1; \
       fi \
    && if ! python -c "import glob, sys, zipfile; \
names = zipfile.ZipFile(glob.glob('/wheels/kvstream-*.whl')[0]).namelist(); \
missing = [m for m in ('schemas/_hotpath', 'stream_apps/residency/_record', 'stream_apps/index/_table') \
           if not any(n.startswith(m + '.') and n.endswith('.so') for n in names)]; \
print('kvstream wheel: ' + ', '.join(n for n in names if n.endswith('.so'))); \
sys.exit('kvstream: the wheel has no compiled ' + ', '.join(missing) if missing else 0)"; then \
           grep -E ": (fatal )?error: |compiled hot path was not built" /tmp/pip-wheel.log; exit 1; \
       fi \
    && ls -l /wheels

FROM base

COPY --from=build /wheels/ /tmp/wheels/
# The direct imports show the loader's error if a module does not load (schemas.compiled would hide it); the
# second check is the choice the worker makes, so KVSTREAM_PURE_PYTHON=1 in the base would fail here too.
RUN pip install /tmp/wheels/kvstream-*.whl \
    && rm -rf /tmp/wheels \
    && python -c "import schemas._hotpath, stream_apps.residency._record, stream_apps.index._table; \
from stream_apps.hotpath import hotpath; \
current = hotpath(); print(current.describe()); \
raise SystemExit(None if current.implementation == 'compiled' \
                 else 'kvstream: the image would run ' + current.describe())" \
    && useradd --system --uid 10001 --home-dir /data --shell /usr/sbin/nologin kvstream \
    && mkdir -p /data \
    && chown kvstream /data

# /data is the worker's state directory (--data-dir /data). It is created here, owned by the
# kvstream user, so a volume mounted on it starts with that ownership.
USER kvstream
WORKDIR /data

ENTRYPOINT ["kvstream"]
CMD ["--help"]
