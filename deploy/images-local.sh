#!/usr/bin/env bash
# make images-local: build STAND-INS for the official images docker-compose.yml and the Dockerfile use, on a
# machine that cannot pull from an image registry but reaches Debian's mirror and Maven Central:
#
#   python:3.11-slim                             Debian 12's Python 3.11 in a venv (deploy/images/python)
#   apache/kafka:4.1.2                           the embedded broker's Kafka 4.1.2 jars on OpenJDK 17 (deploy/images/kafka)
#   apicurio/apicurio-registry-mem:2.6.13.Final  Apicurio Registry's release build on OpenJDK 17 (deploy/images/registry)
#
# They are tagged with the official names by default, so docker-compose.yml, the Dockerfile and
# `make compose-test` use them unchanged, and carry the label org.kvstream.stand-in. They are not the official
# images: on a machine with Docker Hub, use those (docs/deployment.md, "Stand-in images").
#
# Needs root, docker (a running engine), debootstrap and mvn. Variables:
#   PYTHON_IMAGE, KAFKA_IMAGE, REGISTRY_IMAGE  the tags to build (defaults: the official names above)
#   IMAGES_LOCAL_ONLY    comma-separated subset of python,kafka,registry (default: all three)
#   IMAGES_LOCAL_FORCE   1: rebuild the Debian base even if it exists
#   IMAGES_LOCAL_DIR     work directory (default .kvstream/images-local)
#   DEBIAN_MIRROR        default http://deb.debian.org/debian
#   CA_BUNDLE            the CA bundle copied into the images (default the host's /etc/ssl/certs/ca-certificates.crt)
#   KVSTREAM_PY          a Python with kvstream installed, to fetch the Kafka jars (default .venv/bin/python)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=${IMAGES_LOCAL_DIR:-$ROOT/.kvstream/images-local}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
KVSTREAM_PY=${KVSTREAM_PY:-$ROOT/.venv/bin/python}
PYTHON_IMAGE=${PYTHON_IMAGE:-python:3.11-slim}
KAFKA_IMAGE=${KAFKA_IMAGE:-apache/kafka:4.1.2}
REGISTRY_IMAGE=${REGISTRY_IMAGE:-apicurio/apicurio-registry-mem:2.6.13.Final}
ONLY=",${IMAGES_LOCAL_ONLY:-python,kafka,registry},"
APICURIO_VERSION=2.6.13.Final
DEBIAN_IMAGE=kvstream-local/debian:bookworm
JAVA_IMAGE=kvstream-local/java17:bookworm

say() { printf '[images-local] %s\n' "$*"; }
die() { printf '[images-local] error: %s\n' "$*" >&2; exit 1; }
wanted() { [[ "$ONLY" == *",$1,"* ]]; }
have_image() { docker image inspect "$1" >/dev/null 2>&1; }

build() {  # build TAG CONTEXT [docker build args...]: --network host, because with dockerd --iptables=false
    local tag=$1 context=$2 started=$SECONDS  # containers of a build have no outbound route of their own
    shift 2
    say "building $tag from $context"
    docker build --network host --tag "$tag" "$@" "$context"
    say "built $tag in $((SECONDS - started)) s"
}

context() {  # context NAME: a fresh build context with deploy/images/NAME and the CA bundle
    local dir=$WORK/context/$1
    rm -rf "$dir"
    mkdir -p "$dir"
    cp -a "$ROOT/deploy/images/$1/." "$dir/"
    cp "$CA_BUNDLE" "$dir/ca-certificates.crt"
    printf '%s' "$dir"
}

command -v docker >/dev/null || die "docker is not installed (Debian: apt-get install docker.io)"
docker info >/dev/null 2>&1 || die "the Docker engine does not answer (start it: dockerd --iptables=false --storage-driver=vfs &)"
[ -r "$CA_BUNDLE" ] || die "no CA bundle at $CA_BUNDLE (set CA_BUNDLE)"
mkdir -p "$WORK"

# 1. A Debian 12 base image from debootstrap: the root of every stand-in.
if have_image "$DEBIAN_IMAGE" && [ "${IMAGES_LOCAL_FORCE:-0}" != 1 ]; then
    say "$DEBIAN_IMAGE exists (IMAGES_LOCAL_FORCE=1 rebuilds it)"
else
    [ "$(id -u)" = 0 ] || die "debootstrap needs root"
    command -v debootstrap >/dev/null || die "debootstrap is not installed (apt-get install debootstrap)"
    started=$SECONDS
    rootfs=$WORK/rootfs
    rm -rf "$rootfs"
    say "debootstrap --variant=minbase bookworm from $MIRROR"
    debootstrap --variant=minbase bookworm "$rootfs" "$MIRROR" > "$WORK/debootstrap.log" 2>&1 \
        || die "debootstrap failed; see $WORK/debootstrap.log"
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | docker import --change 'CMD ["/bin/bash"]' - "$DEBIAN_IMAGE" >/dev/null
    rm -rf "$rootfs"
    say "built $DEBIAN_IMAGE in $((SECONDS - started)) s"
fi

# 2. python:3.11-slim
if wanted python; then
    build "$PYTHON_IMAGE" "$(context python)" --build-arg "DEBIAN_IMAGE=$DEBIAN_IMAGE"
fi

# 3. OpenJDK 17, shared by the Kafka and registry stand-ins.
if wanted kafka || wanted registry; then
    build "$JAVA_IMAGE" "$(context java)" --build-arg "DEBIAN_IMAGE=$DEBIAN_IMAGE"
fi

# 4. apache/kafka:4.1.2 from the jars the embedded broker caches (~/.cache/kvstream/kafka-<version>/libs).
if wanted kafka; then
    [ -x "$KVSTREAM_PY" ] || die "no $KVSTREAM_PY to fetch the Kafka jars with (make install, or set KVSTREAM_PY)"
    libs=$("$KVSTREAM_PY" -c 'import sys
from kvstream.broker import ensure_jars
print(ensure_jars(progress=lambda line: print(line, file=sys.stderr)))')
    dir=$(context kafka)
    mkdir -p "$dir/libs"
    cp -L "$libs"/*.jar "$dir/libs/"
    say "Kafka jars: $(ls "$dir/libs" | wc -l) from $libs"
    build "$KAFKA_IMAGE" "$dir" --build-arg "JAVA_IMAGE=$JAVA_IMAGE"
fi

# 5. apicurio/apicurio-registry-mem:2.6.13.Final from Maven Central's release build (cached next to the Kafka jars).
if wanted registry; then
    cache=${KVSTREAM_KAFKA_CACHE:-$HOME/.cache/kvstream}/apicurio-registry-$APICURIO_VERSION
    archive=$cache/apicurio-registry-app-$APICURIO_VERSION-all.tar.gz
    if [ ! -s "$archive" ]; then
        command -v mvn >/dev/null || die "mvn is needed once to download Apicurio Registry (apt-get install maven)"
        say "downloading io.apicurio:apicurio-registry-app:$APICURIO_VERSION:tar.gz:all with Maven into $cache"
        # dependency:copy fetches the one artifact, not its dependencies (some live in unreachable repositories).
        mvn -B -q -Dstyle.color=never dependency:copy \
            "-Dartifact=io.apicurio:apicurio-registry-app:$APICURIO_VERSION:tar.gz:all" "-DoutputDirectory=$cache" \
            > "$WORK/maven.log" 2>&1 || die "Maven could not download Apicurio Registry $APICURIO_VERSION; see $WORK/maven.log"
    fi
    dir=$(context registry)
    mkdir -p "$dir/apicurio"
    tar -xzf "$archive" -C "$dir/apicurio"
    build "$REGISTRY_IMAGE" "$dir" --build-arg "JAVA_IMAGE=$JAVA_IMAGE" --build-arg "APICURIO_VERSION=$APICURIO_VERSION"
fi

rm -rf "$WORK/context"
say "stand-in images (label org.kvstream.stand-in):"
docker image ls --filter label=org.kvstream.stand-in --format '  {{.Repository}}:{{.Tag}}  {{.Size}}'
