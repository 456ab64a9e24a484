"""Read the stream app's tables back from their changelog topics, without Faust.

Kafka is the system of record: the residency table can be rebuilt by anyone
from ``<app id>-residency-changelog`` (last value per key wins, an empty value
deletes). The demo and the tests use this to compare the materialized residency
with the simulator's ground truth, row for row.
"""

from __future__ import annotations

from dataclasses import dataclass

from kafka_io.reader import messages_to_end
from schemas import AvroCodec

#: One residency row's identity: (instance, dp rank, tier, ownership, locality, group, block hash bytes).
RowIdentity = tuple


def read_table(bootstrap_servers: str, topic: str, family: str, timeout_s: float = 60.0) -> dict[str, dict]:
    """Read a changelog topic from the beginning to its current end and return the table it describes.

    Args:
        topic: the changelog topic.
        family: schema family of the values (e.g. ``residency``).

    Returns:
        key (str) -> decoded value, tombstones applied.

    Raises:
        TimeoutError: the end offsets were not reached within ``timeout_s``.
        schemas.DecodeError: a value is not a record of ``family``.
    """
    codec = AvroCodec(family)
    table: dict[str, dict] = {}
    for message in messages_to_end(bootstrap_servers, topic, timeout_s):
        key = message.key().decode()
        value = message.value()
        if value:
            table[key] = codec.decode(value)
        else:
            table.pop(key, None)
    return table


def resident_rows(table: dict[str, dict]) -> dict[RowIdentity, int]:
    """Flatten a residency table into ``{row identity: copies}`` for rows with copies > 0."""
    rows = {}
    for entry in table.values():
        for row in entry["rows"]:
            if row["copies"] > 0:
                identity = (row["instance_id"], row["data_parallel_rank"], row["tier"], entry["ownership"],
                            row["locality"], row["group_idx"], entry["block_hash"])
                rows[identity] = row["copies"]
    return rows


@dataclass
class Comparison:
    """Result of :func:`compare_rows`."""

    #: Rows equal on both sides (identity and copies).
    matching: int
    #: Up to ``limit`` differences: (identity, expected copies or None, actual copies or None).
    differences: list[tuple]
    #: Total number of differing rows.
    differing: int

    @property
    def ok(self) -> bool:
        """True when every row matches."""
        return self.differing == 0


def compare_rows(expected: dict[RowIdentity, int], actual: dict[RowIdentity, int], limit: int = 10) -> Comparison:
    """Compare two ``{row identity: copies}`` maps row for row."""
    differences = []
    differing = 0
    for identity in expected.keys() | actual.keys():
        want, got = expected.get(identity), actual.get(identity)
        if want != got:
            differing += 1
            if len(differences) < limit:
                differences.append((identity, want, got))
    matching = sum(1 for identity, copies in expected.items() if actual.get(identity) == copies)
    return Comparison(matching, differences, differing)
