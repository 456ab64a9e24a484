package kvstream.peer;

import java.util.concurrent.atomic.AtomicLong;
import java.util.concurrent.atomic.LongAdder;

/** Counters of the peer, shared by its stream threads and read by GET /stats/. */
final class Stats {
    final LongAdder events = new LongAdder();
    final LongAdder undecodable = new LongAdder();
    final LongAdder ignored = new LongAdder();
    final LongAdder unknownRemovals = new LongAdder();
    final LongAdder clears = new LongAdder();
    final LongAdder clearedKeys = new LongAdder();
    /** Wall clock (ms since the Unix epoch) of the first and the latest event processed; 0 before the first. */
    final AtomicLong firstEventMs = new AtomicLong();
    volatile long lastEventMs;

    void event() {
        events.increment();
        long now = System.currentTimeMillis();
        if (firstEventMs.get() == 0) {
            firstEventMs.compareAndSet(0, now);
        }
        lastEventMs = now;
    }
}
