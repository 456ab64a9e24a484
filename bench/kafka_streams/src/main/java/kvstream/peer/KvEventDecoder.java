package kvstream.peer;

import java.io.IOException;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.file.DirectoryStream;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Map;

import org.apache.avro.Schema;
import org.apache.avro.SchemaNormalization;
import org.apache.avro.generic.GenericDatumReader;
import org.apache.avro.generic.GenericRecord;
import org.apache.avro.io.BinaryDecoder;
import org.apache.avro.io.DecoderFactory;

/**
 * Decodes kv_event values as kvstream's producers frame them: Avro single-object encoding ({@code C3 01}, the
 * writer schema's 8-byte CRC-64-AVRO fingerprint, little-endian, then the body; docs/contract.md, "Framing").
 *
 * <p>Every {@code schemas/kv_event_v*.avsc} is a known writer; records are resolved to the newest version (Avro
 * schema resolution), as kvstream's own codec does. Each file is parsed alone first; if it refers to named types
 * defined elsewhere, it is parsed again after {@code kv_event_v1.avsc} (which defines Tier, AggregationMode and
 * HashEncoding) in the same parser. The Confluent framing ({@code 00} + schema id) needs a registry and is refused.
 */
final class KvEventDecoder {
    private final Map<Long, GenericDatumReader<GenericRecord>> readers = new HashMap<>();
    private final Schema reader;
    private BinaryDecoder decoder;
    private GenericRecord reuse;

    KvEventDecoder(Path schemasDir) throws IOException {
        List<Path> files = new ArrayList<>();
        try (DirectoryStream<Path> dir = Files.newDirectoryStream(schemasDir, "kv_event_v*.avsc")) {
            dir.forEach(files::add);
        }
        if (files.isEmpty()) {
            throw new IOException("no kv_event_v*.avsc in " + schemasDir);
        }
        files.sort((a, b) -> Integer.compare(version(a), version(b)));
        Map<Path, Schema> schemas = new HashMap<>();
        for (Path file : files) {
            schemas.put(file, parse(file, schemasDir.resolve("kv_event_v1.avsc")));
        }
        reader = schemas.get(files.get(files.size() - 1));
        for (Schema writer : schemas.values()) {
            readers.put(SchemaNormalization.parsingFingerprint64(writer), new GenericDatumReader<>(writer, reader));
        }
    }

    private static int version(Path file) {
        String name = file.getFileName().toString();
        return Integer.parseInt(name.substring("kv_event_v".length(), name.length() - ".avsc".length()));
    }

    static Schema parse(Path file, Path v1) throws IOException {
        try {
            return new Schema.Parser().parse(file.toFile());
        } catch (org.apache.avro.SchemaParseException e) {
            // refers to a named type of another file: define them first
            Schema.Parser parser = new Schema.Parser();
            parser.parse(v1.toFile());
            return parser.parse(file.toFile());
        }
    }

    Schema readerSchema() {
        return reader;
    }

    /** The decoded record (the object is reused by the next call), or null for a value that is not a known kv_event. */
    GenericRecord decode(byte[] value) throws IOException {
        if (value == null || value.length < 10 || value[0] != (byte) 0xC3 || value[1] != 0x01) {
            return null;
        }
        long fingerprint = ByteBuffer.wrap(value, 2, 8).order(ByteOrder.LITTLE_ENDIAN).getLong();
        GenericDatumReader<GenericRecord> datumReader = readers.get(fingerprint);
        if (datumReader == null) {
            return null;
        }
        decoder = DecoderFactory.get().binaryDecoder(value, 10, value.length - 10, decoder);
        reuse = datumReader.read(reuse, decoder);
        return reuse;
    }
}
