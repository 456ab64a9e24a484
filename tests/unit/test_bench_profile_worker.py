"""bench.profile_worker's fold of py-spy's raw output into stages (no broker: the samples are given)."""

from bench.profile_worker import fold

WORKER = 'process 100:"python -m kvstream.cli worker --store=rocksdb://"'
CHILD = 'process 200:"python -B -c from multiprocessing.spawn import spawn_main"'
TRACKER = 'process 300:"python -B -c from multiprocessing.resource_tracker import main"'


def _write(tmp_path, lines: list[str]):
    raw = tmp_path / "py-spy.raw"
    raw.write_text("\n".join(lines) + "\n")
    return raw


def test_with_idle_each_thread_has_its_table_and_its_waits_are_stages(tmp_path):
    main = f"{WORKER};thread (100): MainThread;run_forever (asyncio/base_events.py:607)"
    raw = _write(tmp_path, [
        f"{main};_run_once (asyncio/base_events.py:1884);select (selectors.py:468) 30",
        f"{main};materialize_residency (stream_apps/residency/agent.py:80) 50",
        f"{WORKER};thread (101): Thread-1;run (threading.py:975);select (selectors.py:468) 70",
        f"{WORKER};thread (100): MainThread;{CHILD};thread (200): MainThread;_run_child (x.py:1);"
        "spawn_main (multiprocessing/spawn.py:120);consume (stream_apps/repartition/loop.py:200) 40",
        f"{WORKER};thread (100): MainThread;{TRACKER};thread (300): MainThread;main (resource_tracker.py:1) 99",
    ])
    folded = fold(raw, idle=True)
    assert folded["worker MainThread"] == {"waiting: event loop select (nothing ready)": 30,
                                           "materialize loop (agent)": 50}
    assert folded["worker Thread-1"] == {"waiting: event loop select (nothing ready)": 70}
    assert folded["repartition MainThread"] == {"repartition: consume (librdkafka)": 40}
    assert set(folded) == {"worker MainThread", "worker Thread-1", "repartition MainThread"}  # no tracker


def test_without_idle_samples_count_per_process_and_a_select_is_not_a_wait(tmp_path):
    main = f"{WORKER};run_forever (asyncio/base_events.py:607)"
    raw = _write(tmp_path, [
        f"{main};select (selectors.py:468) 3",
        f"{main};materialize_residency (stream_apps/residency/agent.py:80) 5",
    ])
    assert fold(raw) == {"worker": {"Faust, aiokafka, event loop (other)": 3, "materialize loop (agent)": 5}}


def test_the_rekeyed_topic_reader_s_frames_have_stages_of_their_own(tmp_path):
    """The default reader (stream_apps/rekeyed_reader.py) applies in the event loop and fetches in a thread;
    without rules of their own its samples all fell in "other", the compiled loop's with them."""
    loop = f"{WORKER};run_forever (asyncio/base_events.py:607);run (stream_apps/rekeyed_reader.py:227)"
    fetch = f"{WORKER};_bootstrap_inner (threading.py:1045);run (threading.py:982)"
    raw = _write(tmp_path, [
        f"{loop};_apply (stream_apps/rekeyed_reader.py:261);apply_message (stream_apps/materialize.py:79);"
        "apply_all (stream_apps/applier.py:342) 20",
        f"{loop};_apply (stream_apps/rekeyed_reader.py:261);apply_message (stream_apps/materialize.py:79);"
        "apply_all (stream_apps/applier.py:342);entry (stream_apps/store.py:430) 7",
        f"{loop};_apply (stream_apps/rekeyed_reader.py:261);apply_message (stream_apps/materialize.py:84) 2",
        f"{loop};_apply (stream_apps/rekeyed_reader.py:252) 3",
        f"{fetch};_fetch (stream_apps/rekeyed_reader.py:192);_write_to_self (asyncio/selector_events.py:141) 4",
        f"{WORKER};run_forever (asyncio/base_events.py:607);_feed_index (stream_apps/app.py:262);"
        "poll (stream_apps/index/feed.py:161);apply_messages (stream_apps/index/fleet_index.py:180) 5",
    ])
    assert fold(raw) == {"worker": {"materialize loop (agent)": 20, "entry read (cache, RocksDB get)": 7,
                                    "apply bookkeeping": 2, "re-keyed topic reader: hand-off, gate, ack": 3,
                                    "re-keyed topic reader: fetch thread": 4, "embedded index feed": 5}}
