"""A local schema registry: Apicurio Registry serving the Confluent Schema Registry API.

The pipeline's records use the Confluent wire format when a registry is configured (docs/registry.md),
because that is what Kafka Connect, ksqlDB, Flink, Spark and ``kcat -s value=avro`` read. For
development, tests and the demo, this module runs Apicurio Registry (Apache-2.0), whose ready-to-run
build is on Maven Central, the way :mod:`kvstream.broker` runs Kafka:

* :func:`ensure_registry` lets Maven fetch ``io.apicurio:apicurio-registry-app:<version>:tar.gz:all``
  once into ``~/.cache/kvstream/apicurio-registry-<version>/`` (about 140 MB) and unpacks it.
* :func:`start` runs it detached on 127.0.0.1, with its schemas in an H2 database file under the data
  directory (so schema ids survive a restart: records in Kafka refer to them), waits until the
  Confluent API answers, and sets the global compatibility to BACKWARD (Apicurio's default is NONE;
  Confluent's is BACKWARD).

Layout of a registry data directory (default ``.kvstream/registry``)::

    registry.pid        pid of the running registry JVM
    registry.port       its HTTP port
    db/                 the H2 database holding the schemas
    logs/registry.out   the registry's stdout and stderr

Version 2.6.13.Final runs on Java 17 (the 3.x line needs Java 21). Every failure is a
:class:`RegistryError` whose message ends with the relevant log tail.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvstream.broker import (
    default_cache_root,
    file_lock,
    java_executable,
    log_tail,
    pid_of,
    port_in_use,
    terminate_process,
)

#: Apicurio Registry release run by :func:`start`: the newest 2.x, the line that runs on Java 17.
APICURIO_VERSION = "2.6.13.Final"
_ARTIFACT = f"io.apicurio:apicurio-registry-app:{APICURIO_VERSION}:tar.gz:all"
#: The Confluent Schema Registry API's base path in Apicurio.
CONFLUENT_API = "/apis/ccompat/v7"
DEFAULT_DATA_DIR = Path(".kvstream/registry")
#: Confluent's conventional registry port.
DEFAULT_PORT = 8081
#: The global compatibility :func:`start` sets, Confluent's default.
COMPATIBILITY = "BACKWARD"
_MARKER = ".complete"


class RegistryError(RuntimeError):
    """The registry could not be fetched, started, stopped or queried; the message says why."""


@dataclass(frozen=True)
class RegistryStatus:
    """State of the registry belonging to one data directory."""

    #: True while the registry JVM of this data dir is alive.
    running: bool
    #: Its process id, or None when not running.
    pid: int | None
    #: Its HTTP port on 127.0.0.1 from the last start, or None if never started.
    port: int | None
    #: The Confluent-compatible URL clients use (``--schema-registry``), or None.
    url: str | None
    #: Absolute path of the data directory.
    data_dir: Path
    #: Absolute path of the registry's stdout/stderr log.
    log_file: Path


def _install_dir(cache_dir: Path | None) -> Path:
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_root()
    return root.resolve() / f"apicurio-registry-{APICURIO_VERSION}"


def ensure_registry(cache_dir: Path | None = None, progress: Callable[[str], object] = print) -> Path:
    """Make sure Apicurio Registry is downloaded and unpacked; return the path of its runner jar.

    Args:
        cache_dir: cache root (default ``$KVSTREAM_KAFKA_CACHE`` or ``~/.cache/kvstream``).
        progress: called with a line before and after a download (nothing when cached).

    Raises:
        RegistryError: no ``mvn``, or Maven or the unpacking failed.

    The artifact's dependencies are excluded: it is self-contained, and resolving them would ask a
    repository that cannot be reached here. A file lock serialises concurrent callers.
    """
    install = _install_dir(cache_dir)
    runner = install / f"apicurio-registry-app-{APICURIO_VERSION}-runner.jar"
    if (install / _MARKER).is_file() and runner.is_file():
        return runner
    with file_lock(install.parent / ".lock"):
        if (install / _MARKER).is_file() and runner.is_file():
            return runner
        mvn = shutil.which("mvn")
        if mvn is None:
            raise RegistryError("Apache Maven ('mvn') is needed once to download Apicurio Registry, but it is not "
                                "on PATH. Install it (e.g. 'apt-get install maven').")
        tmp = install.parent / f"apicurio.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        progress(f"Downloading Apicurio Registry {APICURIO_VERSION} with Maven into {install} (one-time, ~140 MB)...")
        started = time.monotonic()
        cmd = [mvn, "-B", "-q", "-Dstyle.color=never", "dependency:copy", f"-Dartifact={_ARTIFACT}",
               f"-DoutputDirectory={tmp}", "-Dtransitive=false"]
        proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, cwd=tmp, check=False)
        archives = list(tmp.glob("*.tar.gz"))
        if proc.returncode != 0 or not archives:
            shutil.rmtree(tmp, ignore_errors=True)
            raise RegistryError(f"Maven failed to download {_ARTIFACT} (exit code {proc.returncode}; command: "
                                f"{shlex.join(cmd)}).\n{(proc.stdout + proc.stderr)[-3000:]}")
        try:
            with tarfile.open(archives[0]) as archive:
                archive.extractall(tmp / "app", filter="data")
        except (tarfile.TarError, OSError) as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise RegistryError(f"could not unpack {archives[0].name}: {exc}") from None
        archives[0].unlink()
        app = tmp / "app"
        if not (app / runner.name).is_file():  # the archive may wrap everything in one folder
            inner = [p for p in app.iterdir() if p.is_dir() and (p / runner.name).is_file()]
            if not inner:
                shutil.rmtree(tmp, ignore_errors=True)
                raise RegistryError(f"{_ARTIFACT} holds no {runner.name}")
            app = inner[0]
        (app / _MARKER).write_text(APICURIO_VERSION + "\n")
        shutil.rmtree(install, ignore_errors=True)
        app.rename(install)
        shutil.rmtree(tmp, ignore_errors=True)
        progress(f"Apicurio Registry ready in {time.monotonic() - started:.1f} s")
    return runner


def _paths(data_dir: Path) -> tuple[Path, Path, Path, Path]:
    """(data dir, pid file, port file, log file), all absolute."""
    d = Path(data_dir).expanduser().resolve()
    return d, d / "registry.pid", d / "registry.port", d / "logs" / "registry.out"


def _running_pid(data_dir: Path) -> int | None:
    """Pid of the live registry of ``data_dir`` (per its pid file), else None."""
    d, pid_file, _, _ = _paths(data_dir)
    return pid_of(pid_file, "apicurio-registry-app", str(d))


def status(data_dir: Path = DEFAULT_DATA_DIR) -> RegistryStatus:
    """Report the state of the registry of ``data_dir`` (no network access)."""
    d, _, port_file, log_file = _paths(data_dir)
    pid = _running_pid(d)
    try:
        port = int(port_file.read_text().strip())
    except (OSError, ValueError):
        port = None
    url = f"http://127.0.0.1:{port}{CONFLUENT_API}" if port else None
    return RegistryStatus(pid is not None, pid, port, url, d, log_file)


def _request(url: str, method: str = "GET", body: dict | None = None, timeout_s: float = 5.0) -> dict | list:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/vnd.schemaregistry.v1+json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read() or b"null")


def start(port: int = DEFAULT_PORT, data_dir: Path = DEFAULT_DATA_DIR, timeout_s: float = 120,
          heap: str = "-Xmx384m", cache_dir: Path | None = None,
          progress: Callable[[str], object] = print) -> RegistryStatus:
    """Start the registry of ``data_dir`` on 127.0.0.1:``port`` and wait until its Confluent API answers.

    Does nothing but report when it already runs. Sets the global compatibility to BACKWARD.

    Args:
        port: HTTP port on 127.0.0.1.
        data_dir: pid file, port file, the schemas' database and logs.
        timeout_s: seconds to wait for the API (it answers after 3 to 20 s, depending on the load).
        heap: JVM heap options.
        cache_dir: where the download is cached (see :func:`ensure_registry`).
        progress: called with human-readable lines on a first download.

    Raises:
        RegistryError: the port is taken, Java or Maven is missing, or the registry exited or did not
            answer in time (then it is stopped; the message ends with its log).
    """
    d, pid_file, port_file, log_file = _paths(data_dir)
    d.mkdir(parents=True, exist_ok=True)
    with file_lock(d / ".lock"):
        current = status(d)
        if current.running:
            return current
        if port_in_use(port):
            raise RegistryError(f"port {port} on 127.0.0.1 is already in use; pick another with --port")
        runner = ensure_registry(cache_dir, progress)
        try:
            java = java_executable()
        except RuntimeError as exc:
            raise RegistryError(str(exc)) from None
        log_file.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "HTTP_PORT": str(port),
               # a file, not Apicurio's default in-memory database: schema ids must outlive a restart
               "REGISTRY_DATASOURCE_URL": f"jdbc:h2:file:{d / 'db' / 'registry'}"}
        cmd = [java, *heap.split(), "-Dquarkus.http.host=127.0.0.1", "-Dquarkus.log.console.color=false",
               f"-Dkvstream.registry.dir={d}", "-jar", str(runner)]
        with open(log_file, "ab") as log:
            process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                       env=env, cwd=d, start_new_session=True)
        pid_file.write_text(f"{process.pid}\n")
        port_file.write_text(f"{port}\n")
        url = f"http://127.0.0.1:{port}{CONFLUENT_API}"
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                raise RegistryError(f"Apicurio Registry exited with code {process.returncode} during start-up. "
                                    f"Last lines of {log_file}:\n{log_tail(log_file)}")
            try:
                _request(f"{url}/subjects", timeout_s=2)
                break
            except (OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                terminate_process(process.pid, grace_s=10)
                raise RegistryError(f"Apicurio Registry did not answer on {url} within {timeout_s:g} s and was "
                                    f"stopped. Last lines of {log_file}:\n{log_tail(log_file)}")
            time.sleep(0.25)
        try:
            _request(f"{url}/config", "PUT", {"compatibility": COMPATIBILITY})
        except (OSError, ValueError) as exc:
            raise RegistryError(f"could not set the registry's compatibility to {COMPATIBILITY}: {exc}") from None
        return status(d)


def stop(data_dir: Path = DEFAULT_DATA_DIR) -> bool:
    """Stop the registry of ``data_dir`` (SIGTERM, SIGKILL after 20 s); True if one was running."""
    d, pid_file, _, _ = _paths(data_dir)
    if not d.is_dir():
        return False
    with file_lock(d / ".lock"):
        pid = _running_pid(d)
        if pid is not None:
            terminate_process(pid, grace_s=20)
        pid_file.unlink(missing_ok=True)
    return pid is not None


def _print_status(st: RegistryStatus) -> None:
    state = f"running (pid {st.pid})" if st.running else "not running"
    print(f"Apicurio Registry {APICURIO_VERSION}: {state}")
    print(f"  schema registry URL: {st.url or '-'}")
    print(f"  data dir:            {st.data_dir}")
    print(f"  log file:            {st.log_file}")


def _cli_start(args: argparse.Namespace) -> int:
    try:
        st = start(port=args.port, data_dir=args.data_dir, timeout_s=args.timeout, heap=args.heap)
    except (RegistryError, OSError) as exc:
        print(f"kvstream registry start: error: {exc}", file=sys.stderr)
        return 1
    _print_status(st)
    print(f"  clients need:        export KVSTREAM_SCHEMA_REGISTRY_URL={st.url}")
    return 0


def _cli_stop(args: argparse.Namespace) -> int:
    stopped = stop(args.data_dir)
    print(f"Stopped the registry of {Path(args.data_dir).resolve()}." if stopped else "No registry was running.")
    return 0


def _cli_status(args: argparse.Namespace) -> int:
    st = status(args.data_dir)
    _print_status(st)
    return 0 if st.running else 1


def register_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``registry`` command (``start|stop|status``); each leaf parser sets ``func``."""
    registry = subparsers.add_parser(
        "registry", help="run a local schema registry (Apicurio, Confluent API) for the Confluent wire format",
        description=f"Run Apicurio Registry {APICURIO_VERSION} on 127.0.0.1, serving the Confluent Schema Registry "
        f"API at {CONFLUENT_API} with BACKWARD compatibility. Fetched once with Maven; needs java 17+.")
    sub = registry.add_subparsers(dest="registry_command", metavar="{start,stop,status}", required=True)

    def add_data_dir(p: argparse.ArgumentParser) -> None:
        p.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR, metavar="DIR",
                       help="pid file, schema database, logs/registry.out (default: %(default)s)")

    p = sub.add_parser("start", help="start the registry in the background and wait until it answers",
                       description="Start the registry detached and wait until its Confluent API answers; the first "
                       "start downloads it. Does nothing if it already runs.")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="HTTP port on 127.0.0.1 (default: %(default)s)")
    add_data_dir(p)
    p.add_argument("--timeout", type=float, default=120, metavar="SECONDS", help="start-up timeout (default: 120)")
    p.add_argument("--heap", default="-Xmx384m", metavar="JVM_OPTS", help="JVM heap (default: %(default)s)")
    p.set_defaults(func=_cli_start)
    p = sub.add_parser("stop", help="stop the registry", description="Stop the registry (SIGTERM, then SIGKILL "
                       "after 20 s). Its schemas stay in the data dir for the next start.")
    add_data_dir(p)
    p.set_defaults(func=_cli_stop)
    p = sub.add_parser("status", help="show whether the registry runs (exit code 0 if running, else 1)",
                       description="Print running state, pid, URL and log file. Exit code 0 if running, 1 if not.")
    add_data_dir(p)
    p.set_defaults(func=_cli_status)
    return registry
