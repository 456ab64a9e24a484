"""The Kafka jars, fetched from Maven Central once into a per-version cache.

Kafka has no PyPI package: ``pom.xml`` (next to this file) lists the jars and pins their version, and
:func:`ensure_jars` lets Maven copy them into ``<cache>/kafka-<version>/libs``.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

from kvstream.broker.errors import BrokerError, tail_text
from kvstream.broker.java import java_executable
from kvstream.broker.lock import file_lock

_POM = Path(__file__).resolve().parent / "pom.xml"
_MARKER = ".complete"  # written into the jar directory after a successful download


def _pom_kafka_version() -> str:
    ns = {"m": "http://maven.apache.org/POM/4.0.0"}
    node = ET.parse(_POM).getroot().find("m:properties/m:kafka.version", ns)
    if node is None or not (node.text or "").strip():
        raise RuntimeError(f"{_POM} has no <properties><kafka.version>")
    return node.text.strip()


#: The Kafka version; its only definition is ``<kafka.version>`` in pom.xml.
KAFKA_VERSION = _pom_kafka_version()


def default_cache_root() -> Path:
    """Where downloaded jars are cached: ``$KVSTREAM_KAFKA_CACHE``, else ``~/.cache/kvstream``."""
    env = os.environ.get("KVSTREAM_KAFKA_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvstream"


def _jar_dir(cache_dir: Path | None) -> Path:
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_root()
    return root.resolve() / f"kafka-{KAFKA_VERSION}" / "libs"


def _pom_digest() -> str:
    return hashlib.sha256(_POM.read_bytes()).hexdigest()


def _jars_complete(libs: Path) -> bool:
    marker = libs / _MARKER
    return marker.is_file() and marker.read_text().strip() == _pom_digest()


def ensure_jars(cache_dir: Path | None = None, progress: Callable[[str], object] = print) -> Path:
    """Make sure the Kafka jars are in the local cache and return their directory.

    Args:
        cache_dir: Cache root; the jars go to ``<cache_dir>/kafka-<version>/libs``.
            Default: ``$KVSTREAM_KAFKA_CACHE`` if set, else ``~/.cache/kvstream``.
        progress: Called with one human-readable line before and after a
            download (nothing is reported when the cache is already complete).

    Returns:
        Absolute path of the directory holding all jars (use it as ``<dir>/*``
        on a Java classpath).

    Raises:
        BrokerError: ``mvn`` is not installed, or Maven failed (the message
            ends with the tail of Maven's output).

    The cache is complete when its marker file holds the SHA-256 of pom.xml, so
    a second call neither downloads anything nor starts Maven, and an edited
    pom.xml triggers a fresh download. Downloads go to a temporary directory
    that replaces the old one only on success; a file lock serialises
    concurrent callers. About 55 MB, a few seconds to a minute on first use.
    """
    libs = _jar_dir(cache_dir)
    if _jars_complete(libs):
        return libs
    with file_lock(libs.parent / ".lock"):
        if _jars_complete(libs):  # another process finished while we waited
            return libs
        java_executable()  # Maven needs Java too; fail with the clearer message first
        mvn = shutil.which("mvn")
        if mvn is None:
            raise BrokerError(
                "Apache Maven ('mvn') is needed once to download the Kafka jars, "
                "but it is not on PATH. Install it (e.g. 'apt-get install maven')."
            )
        _download(mvn, libs, progress)
    return libs


def _download(mvn: str, libs: Path, progress: Callable[[str], object]) -> None:
    """Let Maven copy the jars into a temporary directory, then put it in place of ``libs`` (the caller holds the
    cache's lock)."""
    tmp = libs.parent / f"libs.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    progress(f"Downloading Kafka {KAFKA_VERSION} jars with Maven into {libs} (one-time, ~55 MB)...")
    started = time.monotonic()
    cmd = [mvn, "-B", "-q", "-Dstyle.color=never", "-f", str(_POM), "dependency:copy-dependencies"]
    cmd += ["-DincludeScope=runtime", f"-DoutputDirectory={tmp}"]
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if proc.returncode != 0 or not any(tmp.glob("kafka_2.13-*.jar")):
        shutil.rmtree(tmp, ignore_errors=True)
        raise BrokerError(
            f"Maven failed to download the Kafka {KAFKA_VERSION} jars "
            f"(exit code {proc.returncode}; command: {shlex.join(cmd)}).\n"
            f"Last lines of Maven's output:\n{tail_text(proc.stdout + proc.stderr)}"
        )
    (tmp / _MARKER).write_text(_pom_digest() + "\n")
    shutil.rmtree(libs, ignore_errors=True)
    tmp.rename(libs)
    size_mb = sum(p.stat().st_size for p in libs.iterdir()) / 1e6
    progress(f"Kafka jars ready: {size_mb:.0f} MB in {time.monotonic() - started:.1f} s")
