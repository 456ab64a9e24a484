package kvstream.peer;

import java.io.IOException;
import java.io.OutputStream;
import java.net.InetSocketAddress;
import java.nio.charset.StandardCharsets;
import java.nio.file.Path;
import java.util.HashMap;
import java.util.Map;
import java.util.Properties;
import java.util.concurrent.CountDownLatch;

import com.sun.net.httpserver.HttpExchange;
import com.sun.net.httpserver.HttpServer;
import org.apache.kafka.common.serialization.ByteArrayDeserializer;
import org.apache.kafka.common.serialization.Serdes;
import org.apache.kafka.streams.KafkaStreams;
import org.apache.kafka.streams.KeyValue;
import org.apache.kafka.streams.StoreQueryParameters;
import org.apache.kafka.streams.StreamsConfig;
import org.apache.kafka.streams.Topology;
import org.apache.kafka.streams.state.KeyValueIterator;
import org.apache.kafka.streams.state.QueryableStoreTypes;
import org.apache.kafka.streams.state.ReadOnlyKeyValueStore;
import org.apache.kafka.streams.state.Stores;

/**
 * The Kafka Streams peer of {@code make bench}: {@code java -cp ... kvstream.peer.Main --bootstrap HOST:PORT
 * --app-id ID --state-dir DIR --schemas DIR --http-port N [--topic kv-events] [--threads 1] [--commit-ms 1000]
 * [--cache-mib 10]}.
 *
 * <p>Runs until SIGTERM. {@code GET /stats/} answers the counters as JSON; {@code GET /rows/} scans every local
 * store and answers the resident rows and keys (for the end of a run: it reads the whole store).
 */
public final class Main {
    private Main() {
    }

    public static void main(String[] args) throws Exception {
        Map<String, String> opts = new HashMap<>(Map.of("--topic", "kv-events", "--threads", "1",
                "--commit-ms", "1000", "--cache-mib", "10"));
        for (int i = 0; i + 1 < args.length; i += 2) {
            opts.put(args[i], args[i + 1]);
        }
        for (String required : new String[] {"--bootstrap", "--app-id", "--state-dir", "--schemas", "--http-port"}) {
            if (!opts.containsKey(required)) {
                System.err.println("missing " + required);
                System.exit(2);
            }
        }
        new KvEventDecoder(Path.of(opts.get("--schemas"))); // fails fast on a missing or broken schema
        Stats stats = new Stats();

        Topology topology = new Topology();
        topology.addSource("kv-events", new ByteArrayDeserializer(), new ByteArrayDeserializer(), opts.get("--topic"));
        // one decoder per task (the decoder reuses its buffers): the supplier is called once per task
        topology.addProcessor("residency", () -> {
            try {
                return new ResidencyProcessor(new KvEventDecoder(Path.of(opts.get("--schemas"))), stats);
            } catch (IOException e) {
                throw new IllegalStateException(e);
            }
        }, "kv-events");
        topology.addStateStore(Stores.keyValueStoreBuilder(Stores.persistentKeyValueStore(ResidencyProcessor.STORE),
                        Serdes.String(), Serdes.ByteArray())
                .withCachingEnabled() // as the DSL's stores: writes to one key within a commit interval are merged
                .withLoggingEnabled(Map.of()), "residency");

        Properties props = new Properties();
        props.put(StreamsConfig.APPLICATION_ID_CONFIG, opts.get("--app-id"));
        props.put(StreamsConfig.BOOTSTRAP_SERVERS_CONFIG, opts.get("--bootstrap"));
        props.put(StreamsConfig.STATE_DIR_CONFIG, opts.get("--state-dir"));
        props.put(StreamsConfig.NUM_STREAM_THREADS_CONFIG, Integer.parseInt(opts.get("--threads")));
        props.put(StreamsConfig.COMMIT_INTERVAL_MS_CONFIG, Long.parseLong(opts.get("--commit-ms")));
        props.put(StreamsConfig.STATESTORE_CACHE_MAX_BYTES_CONFIG, Long.parseLong(opts.get("--cache-mib")) << 20);
        props.put(StreamsConfig.REPLICATION_FACTOR_CONFIG, 1);
        props.put(StreamsConfig.PROCESSING_GUARANTEE_CONFIG, StreamsConfig.AT_LEAST_ONCE);
        props.put(StreamsConfig.consumerPrefix("auto.offset.reset"), "earliest");

        KafkaStreams streams = new KafkaStreams(topology, props);
        CountDownLatch stopped = new CountDownLatch(1);
        streams.setUncaughtExceptionHandler(e -> {
            e.printStackTrace();
            stopped.countDown();
            return org.apache.kafka.streams.errors.StreamsUncaughtExceptionHandler.StreamThreadExceptionResponse
                    .SHUTDOWN_CLIENT;
        });

        HttpServer http = HttpServer.create(new InetSocketAddress("127.0.0.1",
                Integer.parseInt(opts.get("--http-port"))), 0);
        http.createContext("/stats/", ex -> answer(ex, String.format(
                "{\"state\":\"%s\",\"events\":%d,\"undecodable\":%d,\"ignored\":%d,\"unknown_removals\":%d,"
                        + "\"clears\":%d,\"cleared_keys\":%d,\"first_event_ms\":%d,\"last_event_ms\":%d}",
                streams.state(), stats.events.sum(), stats.undecodable.sum(), stats.ignored.sum(),
                stats.unknownRemovals.sum(), stats.clears.sum(), stats.clearedKeys.sum(), stats.firstEventMs.get(),
                stats.lastEventMs)));
        http.createContext("/rows/", ex -> {
            long keys = 0;
            long rows = 0;
            long copies = 0;
            ReadOnlyKeyValueStore<String, byte[]> store = streams.store(StoreQueryParameters.fromNameAndType(
                    ResidencyProcessor.STORE, QueryableStoreTypes.keyValueStore()));
            try (KeyValueIterator<String, byte[]> it = store.all()) {
                while (it.hasNext()) {
                    KeyValue<String, byte[]> kv = it.next();
                    keys++;
                    for (Rows.Row row : Rows.decode(kv.value)) {
                        if (row.count > 0) {
                            rows++;
                            copies += row.count;
                        }
                    }
                }
            }
            answer(ex, String.format("{\"keys\":%d,\"resident_rows\":%d,\"copies\":%d}", keys, rows, copies));
        });
        http.start();

        Runtime.getRuntime().addShutdownHook(new Thread(() -> {
            streams.close();
            http.stop(0);
            stopped.countDown();
        }));
        streams.start();
        System.out.println("kvstream-peer started: app id " + opts.get("--app-id") + ", http port "
                + opts.get("--http-port"));
        stopped.await();
        streams.close();
        http.stop(0);
    }

    private static void answer(HttpExchange exchange, String json) throws IOException {
        byte[] body = json.getBytes(StandardCharsets.UTF_8);
        exchange.getResponseHeaders().add("Content-Type", "application/json");
        exchange.sendResponseHeaders(200, body.length);
        try (OutputStream out = exchange.getResponseBody()) {
            out.write(body);
        }
    }
}
