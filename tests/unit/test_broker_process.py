"""kvstream.broker.process.pid_of: the pid file guard the broker and the schema registry share."""

from __future__ import annotations

import subprocess
import sys

from kvstream.broker.process import pid_of


def test_a_pid_file_names_its_process_only_while_that_process_runs_with_the_markers(tmp_path):
    program = "import time; print('up', flush=True); time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", program, "kvstream-marker", str(tmp_path)], stdout=subprocess.PIPE)
    # Popen returns once the exec has begun, but the kernel sets the new command line a moment later, and
    # /proc/<pid>/cmdline reads empty until it has (CI caught that window once). The child's first line means its
    # exec is done.
    assert child.stdout.readline() == b"up\n"
    pid_file = tmp_path / "service.pid"
    pid_file.write_text(f"{child.pid}\n")
    try:
        assert pid_of(pid_file, "kvstream-marker", str(tmp_path)) == child.pid
        assert pid_of(pid_file, "kvstream-marker", "another data dir") is None  # a reused pid is not ours
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
    assert pid_of(pid_file, "kvstream-marker") is None  # the process is gone
    assert pid_of(tmp_path / "missing.pid") is None
    (tmp_path / "garbled.pid").write_text("not a pid")
    assert pid_of(tmp_path / "garbled.pid") is None
