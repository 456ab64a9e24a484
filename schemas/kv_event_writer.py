"""The hand-written encoder of ``kv_event`` records (the producers' per-block messages): :class:`KvEventWriter`,
byte for byte what fastavro writes, several times faster.

It refuses a codec of any other family or version than the one it encodes, so a new schema version falls back to
fastavro rather than writing wrong bytes.
"""

from __future__ import annotations

from schemas.avro_primitives import (
    AVRO_NULL,
    BRANCH_1,
    avro_bytes,
    avro_double,
    avro_int_array,
    avro_long,
    avro_optional,
    avro_string,
)
from schemas.codec import AvroCodec


def _enum_symbols(schema: dict, field_names: tuple[str, ...]) -> dict[str, dict[str, bytes]]:
    """Per field of a record: enum symbol -> its encoded index (the enum alone or the non-null union branch)."""
    found = {}
    for f in schema["fields"]:
        if f["name"] not in field_names:
            continue
        kind = f["type"]
        optional = isinstance(kind, list)
        enum = kind[1] if optional else kind
        found[f["name"]] = {symbol: (BRANCH_1 if optional else b"") + avro_long(i)
                            for i, symbol in enumerate(enum["symbols"])}
    return found


class KvEventWriter:
    """Hand-written encoder of ``kv_event`` records, byte for byte what :meth:`AvroCodec.encode` writes.

    fastavro's generic writer resolves every union and looks up every field of every record; a
    producer writes hundreds of thousands of records per second that share most of their bytes. This
    writer encodes the field layout of ``kv_event_v6.avsc`` directly and gives the pieces that
    :class:`producers.split.BlockEncoder` reuses across the blocks of one engine event. The
    output is checked against fastavro in ``tests/unit/test_split.py``.

    Args:
        codec: a ``kv_event`` codec writing version 6 (its framing header is reused).

    Raises:
        ValueError: the codec writes another family or version (the field layout coded here would not
            match); use :meth:`AvroCodec.encode` then.
    """

    #: The writer schema whose field layout this class encodes.
    VERSION = 6

    def __init__(self, codec: AvroCodec) -> None:
        if codec.family != "kv_event" or codec.schema.version != self.VERSION:
            raise ValueError(f"KvEventWriter encodes kv_event v{self.VERSION}, not "
                             f"{codec.family} v{codec.schema.version}")
        parsed = codec.schema.parsed
        self.header = codec.header
        enums = _enum_symbols(parsed, ("aggregation", "hash_encoding", "tier"))
        #: symbol -> encoded enum (or ["null", enum] union branch + index) of each enum field.
        self.aggregation = {None: AVRO_NULL, **enums["aggregation"]}
        self.hash_encoding = enums["hash_encoding"]
        self.tier = {None: AVRO_NULL, **enums["tier"]}
        event_field = next(f for f in parsed["fields"] if f["name"] == "event")
        #: full branch name -> encoded union index of the event.
        self.branch = {b["name"]: avro_long(i) for i, b in enumerate(event_field["type"])}
        self._prefixes: dict[tuple, bytes] = {}
        self._middles: dict[tuple, bytes] = {}
        self._tails: dict[tuple, bytes] = {}
        self._removed: dict[tuple, bytes] = {}
        self._suffixes: dict[tuple, bytes] = {}

    def prefix(self, instance_id: str, data_parallel_rank: int, worker_rank: int | None, world_size: int | None,
               aggregation: str | None, publisher_epoch: int) -> bytes:
        """Header and the source's fields (``instance_id`` .. ``publisher_epoch``), cached per source."""
        key = (instance_id, data_parallel_rank, worker_rank, world_size, aggregation, publisher_epoch)
        cached = self._prefixes.get(key)
        if cached is None:
            cached = b"".join((self.header, avro_string(instance_id), avro_long(data_parallel_rank),
                               avro_optional(worker_rank, avro_long), avro_optional(world_size, avro_long),
                               self.aggregation[aggregation], avro_long(publisher_epoch)))
            if len(self._prefixes) > 100_000:
                self._prefixes.clear()
            self._prefixes[key] = cached
        return cached

    def stored_middle(self, body: dict) -> bytes:
        """BlockStored's ``block_size`` .. ``lora_name`` (the same for every block of an event), cached."""
        key = (body["block_size"], body["lora_id"], body["medium"], body["lora_name"])
        cached = self._middles.get(key)
        if cached is None:
            cached = self._middles[key] = self._bounded(self._middles, self._stored_middle(body))
        return cached

    def stored_tail(self, body: dict) -> bytes:
        """BlockStored's ``group_idx`` .. ``session_id`` (the same for every block of an event), cached."""
        key = (body["group_idx"], body["kv_cache_spec_kind"], body["kv_cache_spec_sliding_window"], body["locality"],
               body["ownership"], body["session_id"])
        cached = self._tails.get(key)
        if cached is None:
            cached = self._tails[key] = self._bounded(self._tails, self._stored_tail(body))
        return cached

    def stored_suffix(self, cache_salt: str | None, token_id_width: int | None) -> bytes:
        """BlockStored's fields ``cache_salt`` and ``token_id_width`` (added in v3, after ``parent_known``), cached;
        ``content_hash`` (v4), which differs per block, follows them."""
        key = (cache_salt, token_id_width)
        cached = self._suffixes.get(key)
        if cached is None:
            cached = self._suffixes[key] = self._bounded(self._suffixes, avro_optional(cache_salt, avro_string)
                                                         + avro_optional(token_id_width, avro_long))
        return cached

    @staticmethod
    def report_mode(mode: str | None) -> bytes:
        """BlockStored's ``report_mode`` (v5, the last field; the same for every store of a source)."""
        return avro_optional(mode, avro_string)

    def removed_body(self, body: dict) -> bytes:
        """A BlockRemoved body, cached."""
        key = (body["medium"], body["group_idx"], body["locality"], body["ownership"])
        cached = self._removed.get(key)
        if cached is None:
            cached = self._removed[key] = self._bounded(self._removed, self._removed_body(body))
        return cached

    @staticmethod
    def _bounded(cache: dict, value: bytes) -> bytes:
        """``value``; empties ``cache`` first when it has grown past 10,000 entries (distinct field values)."""
        if len(cache) > 10_000:
            cache.clear()
        return value

    @staticmethod
    def _stored_middle(body: dict) -> bytes:
        return b"".join((avro_long(body["block_size"]), avro_optional(body["lora_id"], avro_long),
                         avro_optional(body["medium"], avro_string), avro_optional(body["lora_name"], avro_string)))

    @staticmethod
    def _stored_tail(body: dict) -> bytes:
        return b"".join((avro_optional(body["group_idx"], avro_long),
                         avro_optional(body["kv_cache_spec_kind"], avro_string),
                         avro_optional(body["kv_cache_spec_sliding_window"], avro_long),
                         avro_optional(body["locality"], avro_string), avro_optional(body["ownership"], avro_string),
                         avro_optional(body["session_id"], avro_string)))

    @staticmethod
    def _removed_body(body: dict) -> bytes:
        return b"".join((avro_optional(body["medium"], avro_string), avro_optional(body["group_idx"], avro_long),
                         avro_optional(body["locality"], avro_string), avro_optional(body["ownership"], avro_string)))

    def encode(self, record: dict) -> bytes:
        """Encode one whole record (any event type), framing included.

        Raises:
            KeyError, TypeError, AttributeError: the record lacks a field or has one of the wrong type
                (fastavro would raise too; the producers only pass records from :mod:`producers.split`).
        """
        kind, body = record["event"]
        if kind == "kvstream.v1.BlockStored":
            pk = body.get("parent_known")
            event = b"".join((avro_optional(body["parent_block_hash"], avro_bytes), avro_int_array(body["token_ids"]),
                              self.stored_middle(body), avro_optional(body["extra_keys"], avro_bytes),
                              self.stored_tail(body), avro_optional(body["lookahead_token_ids"], avro_int_array),
                              AVRO_NULL if pk is None else (b"\x02\x01" if pk else b"\x02\x00"),
                              self.stored_suffix(body.get("cache_salt"), body.get("token_id_width")),
                              avro_optional(body.get("content_hash"), avro_long),
                              avro_optional(body.get("report_mode"), avro_string)))
        elif kind == "kvstream.v1.BlockRemoved":
            event = self.removed_body(body)
        elif kind == "kvstream.v1.AllBlocksCleared":
            event = b""
        elif kind == "kvstream.v1.PublisherRestarted":
            event = avro_optional(body.get("previous_epoch"), avro_long)
        elif kind == "kvstream.v1.SourceStale":
            event = avro_long(body["first_lost_seq"]) + avro_long(body["last_lost_seq"])
        elif kind == "kvstream.v1.SourceHeartbeat":
            event = avro_optional(body.get("evidence"), avro_string)
        elif kind == "kvstream.v1.SourceUnregistered":
            event = (b"\x01" if body.get("all_ranks", True) else b"\x00") + avro_optional(body.get("reason"),
                                                                                          avro_string)
        elif kind == "kvstream.v1.SourceDisconnected":
            event = avro_optional(body.get("reason"), avro_string)
        else:
            raise ValueError(f"{kind!r} is not a branch of the kv_event event union")
        return b"".join((
            self.prefix(record["instance_id"], record["data_parallel_rank"], record["worker_rank"],
                        record["world_size"], record["aggregation"], record["publisher_epoch"]),
            avro_long(record["seq"]), avro_long(record["batch_index"]), avro_double(record["ts"]),
            avro_optional(record["block_hash"], avro_bytes), self.hash_encoding[record["hash_encoding"]],
            avro_long(record["block_index"]), avro_long(record["block_count"]), self.tier[record["tier"]],
            self.branch[kind], event))
