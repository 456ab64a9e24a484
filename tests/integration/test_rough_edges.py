"""Rough edges a new user met (issue 28) that need the session broker to show."""

from __future__ import annotations

import json
import uuid

import pytest

pytestmark = pytest.mark.integration


def test_produce_counts_the_bridges_loss_report_apart_from_block_events(kafka_bootstrap, tmp_path, capsys):
    """A capture taken mid-stream starts at a seq above 0: the bridge's path reports the seqs before it as lost (a
    SourceStale on every partition). With every event of the file dead-lettered, produce said "produced 2
    messages" (the report's copies) and exited 0."""
    from kafka_io.reader import messages_to_end
    from kvstream.cli import main

    prefix = f"rough-{uuid.uuid4().hex[:8]}."
    capture = tmp_path / "capture.jsonl"
    capture.write_text(json.dumps({"instance_id": "engine-0", "seq": 3, "ts": 1.0,
                                   "events": [{"type": "NoSuchEvent"}, {"type": "BlockStored"}]}) + "\n")
    code = main(["produce", f"--jsonl={capture}", f"--bootstrap-servers={kafka_bootstrap}", f"--topic-prefix={prefix}",
                 "--partitions=2"])
    out, err = capsys.readouterr()
    assert code == 1, out + err
    assert f"produced 0 messages to {prefix}kv-events" in out
    assert "1 report of lost seqs (SourceStale, 2 messages)" in out and "no heartbeat" in out
    assert "2 inputs to the dead-letter topic" in out
    assert "nothing was accepted: every input went to the dead-letter topic" in err and "Traceback" not in err
    # the report is on kv-events, once per partition, and nothing else: no block event, no heartbeat
    assert len(list(messages_to_end(kafka_bootstrap, f"{prefix}kv-events"))) == 2
