package kvstream.peer;

import java.nio.ByteBuffer;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.List;
import java.util.Objects;

/**
 * The value of one residency key ({@code <ownership or primary>/<hash hex>}): one row per residency identity
 * (instance, data-parallel rank, tier, locality, KV cache group; docs/residency.md), each with its reference count
 * and the engine time it became resident. A compact binary layout, not Avro: the peer's store is its own.
 */
final class Rows {
    static final class Row {
        final String instance;
        final int dpRank;
        final byte tier;
        final String locality; // nullable
        final Integer group; // nullable
        int count;
        double since;

        Row(String instance, int dpRank, byte tier, String locality, Integer group, int count, double since) {
            this.instance = instance;
            this.dpRank = dpRank;
            this.tier = tier;
            this.locality = locality;
            this.group = group;
            this.count = count;
            this.since = since;
        }

        boolean is(String instance, int dpRank, byte tier, String locality, Integer group) {
            return this.dpRank == dpRank && this.tier == tier && this.instance.equals(instance)
                    && Objects.equals(this.locality, locality) && Objects.equals(this.group, group);
        }
    }

    private Rows() {
    }

    static List<Row> decode(byte[] value) {
        List<Row> rows = new ArrayList<>(2);
        if (value == null) {
            return rows;
        }
        ByteBuffer in = ByteBuffer.wrap(value);
        int n = in.get() & 0xFF;
        for (int i = 0; i < n; i++) {
            String instance = string(in);
            int dp = in.getInt();
            byte tier = in.get();
            String locality = in.get() == 0 ? null : string(in);
            Integer group = in.get() == 0 ? null : in.getInt();
            int count = in.getInt();
            double since = in.getDouble();
            rows.add(new Row(instance, dp, tier, locality, group, count, since));
        }
        return rows;
    }

    static byte[] encode(List<Row> rows) {
        int size = 1;
        List<byte[]> names = new ArrayList<>(rows.size() * 2);
        for (Row r : rows) {
            byte[] inst = r.instance.getBytes(StandardCharsets.UTF_8);
            byte[] loc = r.locality == null ? null : r.locality.getBytes(StandardCharsets.UTF_8);
            names.add(inst);
            names.add(loc);
            size += 2 + inst.length + 4 + 1 + 1 + (loc == null ? 0 : 2 + loc.length) + 1 + (r.group == null ? 0 : 4)
                    + 4 + 8;
        }
        ByteBuffer out = ByteBuffer.allocate(size);
        out.put((byte) rows.size());
        int i = 0;
        for (Row r : rows) {
            byte[] inst = names.get(i++);
            byte[] loc = names.get(i++);
            out.putShort((short) inst.length).put(inst);
            out.putInt(r.dpRank).put(r.tier);
            if (loc == null) {
                out.put((byte) 0);
            } else {
                out.put((byte) 1).putShort((short) loc.length).put(loc);
            }
            if (r.group == null) {
                out.put((byte) 0);
            } else {
                out.put((byte) 1).putInt(r.group);
            }
            out.putInt(r.count).putDouble(r.since);
        }
        return out.array();
    }

    private static String string(ByteBuffer in) {
        int len = in.getShort() & 0xFFFF;
        String s = new String(in.array(), in.position(), len, StandardCharsets.UTF_8);
        in.position(in.position() + len);
        return s;
    }
}
