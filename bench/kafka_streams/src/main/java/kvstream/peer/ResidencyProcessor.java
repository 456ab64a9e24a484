package kvstream.peer;

import java.io.IOException;
import java.nio.ByteBuffer;
import java.util.ArrayList;
import java.util.List;

import org.apache.avro.generic.GenericEnumSymbol;
import org.apache.avro.generic.GenericRecord;
import org.apache.kafka.streams.KeyValue;
import org.apache.kafka.streams.processor.api.Processor;
import org.apache.kafka.streams.processor.api.ProcessorContext;
import org.apache.kafka.streams.processor.api.Record;
import org.apache.kafka.streams.state.KeyValueIterator;
import org.apache.kafka.streams.state.KeyValueStore;

/**
 * The core of kvstream's job on one kv-events partition (one task): reference-counted residency rows per
 * (ownership, block hash), and AllBlocksCleared applied by a scan of the partition's store.
 *
 * <p>kv-events is keyed by block hash, so every event of a block (whatever its ownership) and every copy of a
 * source's clear reach one partition in order: the peer needs no repartition. It has no per-worker aggregation,
 * no epochs and no per-row idempotency (kvstream's rules, docs/residency.md): it counts every event as it comes.
 * A clear removes the source's (instance, data-parallel rank) rows on the GPU tier (kvstream's default scope).
 */
final class ResidencyProcessor implements Processor<byte[], byte[], Void, Void> {
    static final String STORE = "residency";
    private static final char[] HEX = "0123456789abcdef".toCharArray();

    private final KvEventDecoder decoder;
    private final Stats stats;
    private final byte gpu;
    private KeyValueStore<String, byte[]> store;

    ResidencyProcessor(KvEventDecoder decoder, Stats stats) {
        this.decoder = decoder;
        this.stats = stats;
        this.gpu = (byte) decoder.readerSchema().getField("tier").schema().getTypes().get(1).getEnumOrdinal("GPU");
    }

    @Override
    public void init(ProcessorContext<Void, Void> context) {
        store = context.getStateStore(STORE);
    }

    @Override
    public void process(Record<byte[], byte[]> record) {
        stats.event();
        GenericRecord event;
        try {
            event = decoder.decode(record.value());
        } catch (IOException | RuntimeException e) {
            event = null;
        }
        if (event == null) {
            stats.undecodable.increment();
            return;
        }
        GenericRecord body = (GenericRecord) event.get("event");
        String kind = body.getSchema().getName();
        switch (kind) {
            case "BlockStored" -> block(event, body, true);
            case "BlockRemoved" -> block(event, body, false);
            case "AllBlocksCleared" -> clear(event.get("instance_id").toString(), (Integer) event.get("data_parallel_rank"));
            default -> stats.ignored.increment(); // PublisherRestarted, SourceStale: the peer has no epochs
        }
    }

    private void block(GenericRecord event, GenericRecord body, boolean stored) {
        Object ownership = body.get("ownership");
        ByteBuffer hash = (ByteBuffer) event.get("block_hash");
        StringBuilder key = new StringBuilder(24);
        key.append(ownership == null ? "primary" : ownership.toString()).append('/');
        for (int i = hash.position(); i < hash.limit(); i++) {
            int b = hash.get(i) & 0xFF;
            key.append(HEX[b >>> 4]).append(HEX[b & 0xF]);
        }
        String k = key.toString();
        String instance = event.get("instance_id").toString();
        int dp = (Integer) event.get("data_parallel_rank");
        GenericEnumSymbol<?> tierSymbol = (GenericEnumSymbol<?>) event.get("tier");
        byte tier = (byte) tierSymbol.getSchema().getEnumOrdinal(tierSymbol.toString());
        Object localityValue = body.get("locality");
        String locality = localityValue == null ? null : localityValue.toString();
        Integer group = (Integer) body.get("group_idx");
        double ts = (Double) event.get("ts");

        List<Rows.Row> rows = Rows.decode(store.get(k));
        Rows.Row row = null;
        for (Rows.Row candidate : rows) {
            if (candidate.is(instance, dp, tier, locality, group)) {
                row = candidate;
                break;
            }
        }
        if (row == null) {
            if (!stored) {
                stats.unknownRemovals.increment();
                return;
            }
            row = new Rows.Row(instance, dp, tier, locality, group, 0, ts);
            rows.add(row);
        }
        if (stored) {
            if (row.count++ == 0) {
                row.since = ts;
            }
        } else if (row.count > 0) {
            row.count--;
        } else {
            stats.unknownRemovals.increment();
        }
        if (row.count == 0) {
            rows.remove(row);
        }
        if (rows.isEmpty()) {
            store.delete(k);
        } else {
            store.put(k, Rows.encode(rows));
        }
    }

    private void clear(String instance, int dp) {
        stats.clears.increment();
        List<KeyValue<String, byte[]>> changes = new ArrayList<>();
        try (KeyValueIterator<String, byte[]> it = store.all()) {
            while (it.hasNext()) {
                KeyValue<String, byte[]> kv = it.next();
                List<Rows.Row> rows = Rows.decode(kv.value);
                boolean changed = rows.removeIf(r -> r.dpRank == dp && r.tier == gpu && r.instance.equals(instance));
                if (changed) {
                    changes.add(KeyValue.pair(kv.key, rows.isEmpty() ? null : Rows.encode(rows)));
                }
            }
        }
        for (KeyValue<String, byte[]> change : changes) {
            if (change.value == null) {
                store.delete(change.key);
            } else {
                store.put(change.key, change.value);
            }
        }
        stats.clearedKeys.add(changes.size());
    }

    @Override
    public void close() {
    }
}
