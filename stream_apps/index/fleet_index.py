"""The fleet index: every resident (block, holder) of the whole fleet in one compact table, and its lookups.

One :class:`FleetIndex` per process. It is fed with residency-table entries (``apply_entry``, from
:mod:`stream_apps.index.feed`, which reads ``<app id>-residency-changelog``), and answers without a network hop:

* by the engine's block hashes (``prefix_match``, ``query_hashes``): a walk of the chain, block by block;
* by token ids (``query_tokens``): the content hashes of the request's blocks (:mod:`schemas.content_hash`),
  chained along the engines' parent hashes by the table's content walk, so the answer does not depend on the
  engines' hash seeds (the dual key: docs/querying.md, "For router authors").

Holders are (instance, data-parallel rank, tier, ownership); the source metadata routers register (model, block
size, tenant, hash profile) lives in :class:`SourceRegistry`. Every public method takes the index's lock, so a
feed in another thread and queries in an event loop can share one index.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from schemas.content_hash import block_content_digests, token_bytes
from schemas.engine_hashes import HashProfile, engine_block_hashes
from stream_apps.index.entry_reader import index_entry_of
from stream_apps.index.fresh import DEFAULT_WINDOW_S, FreshLayer
from stream_apps.index.liveness import SourceLeases
from stream_apps.index.scoring import HolderInfo, PrefixRun, instances_answer, prefix_match_rows, table_prefix_runs
from stream_apps.index.sources import DEFAULT_BLOCK_SIZE, DEFAULT_TENANT, SourceInfo, SourceRegistry
from stream_apps.index.table import BlockTable, block_key, block_keys, residency_key_block
from stream_apps.index.table_keys import PRIMARY

#: Re-exported: the registry's names were defined here before :mod:`stream_apps.index.sources`.
__all__ = ["DEFAULT_BLOCK_SIZE", "DEFAULT_TENANT", "FleetIndex", "IndexCounters", "SourceInfo", "SourceRegistry"]

_U64 = (1 << 64) - 1
@dataclass
class IndexCounters:
    """What the index has applied and seen (``GET /workers``, ``GET /metrics``)."""

    #: Residency entries applied (values and tombstones).
    entries_applied: int = 0
    #: Token queries in which one depth matched blocks under more than one engine hash: equal content under
    #: unequal engine hashes, what a fleet with mixed hash seeds looks like.
    mixed_hash_queries: int = 0
    #: Instance sets seen holding equal content under unequal engine hashes (up to 16 kept).
    mixed_hash_instances: list = field(default_factory=list)


def _parse_key(key: str) -> tuple[str | None, bytes]:
    ownership, _, hex_hash = key.rpartition("/")
    return (None if ownership == PRIMARY else ownership), bytes.fromhex(hex_hash)


class FleetIndex:
    """Every resident (block, holder) of the fleet, and the lookups routers make (module docstring).

    Args:
        weights: tier -> weight of the prefix-match score (llm-d's convention; others 0.25).
        default_block_size: tokens per block of an instance that registered none.
        table: the block table (tests pass a pure-Python one); default: the compiled one where built.
        fresh_window_s: seconds an override of the fresh layer outlives a changelog record that disagrees with
            it (:mod:`stream_apps.index.fresh`).
    """

    def __init__(self, weights: Mapping[str, float] | None = None, default_block_size: int = DEFAULT_BLOCK_SIZE,
                 table=None, fresh_window_s: float = DEFAULT_WINDOW_S) -> None:
        self.weights = dict(weights or {"GPU": 1.0, "CPU": 0.8, "STORAGE": 0.5})
        self.sources = SourceRegistry(default_block_size)
        self.counters = IndexCounters()
        #: The sources' leases (set by whoever feeds them: a worker from its ``sources`` table, a replica from its
        #: changelog); None: every source counts as live.
        self.leases: SourceLeases | None = None
        #: Taken by every public method: the feed may run in another thread than the queries.
        self.lock = threading.RLock()
        self._table = table if table is not None else BlockTable()
        self._holders: list[HolderInfo] = []
        self._holder_ids: dict[HolderInfo, int] = {}
        self._scopes: dict[str | None, int] = {}
        #: scope id -> its ownership (the inverse of ``_scopes``).
        self._scope_owners: list[str | None] = []
        #: ownership -> (instance_id, data_parallel_rank, tier) -> holder id: :meth:`apply_rows`'s look-up, by the
        #: row tuples it is given (so no HolderInfo is built per row).
        self._row_holders: dict[str | None, dict[tuple, int]] = {}
        #: (model, tenant, block size) -> (stamp, verdict bytes over holder ids): :meth:`_allowed`'s cache.
        self._verdict_cache: dict[tuple, tuple[tuple, bytes]] = {}
        #: (model, tenant) -> (stamp, block sizes): :meth:`_block_sizes`'s cache.
        self._size_cache: dict[tuple, tuple[tuple, list[int]]] = {}
        #: The engines' block events applied as they arrive, over the changelog (:mod:`stream_apps.index.fresh`);
        #: fed by :class:`~stream_apps.index.events_feed.EventsFeed` with the lock held.
        self.fresh = FreshLayer(self._table, self._scope, self._scope_owners.__getitem__, self._holder_id,
                                self._holders, fresh_window_s)

    # -- feeding ---------------------------------------------------------------------------------------------

    def _holder_id(self, info: HolderInfo) -> int:
        holder = self._holder_ids.get(info)
        if holder is None:
            holder = self._holder_ids[info] = len(self._holders)
            self._holders.append(info)
        return holder

    def _scope(self, ownership: str | None) -> int:
        scope = self._scopes.get(ownership)
        if scope is None:
            scope = self._scopes[ownership] = len(self._scopes)
            self._scope_owners.append(ownership)
        return scope

    def apply_entry(self, key: str, entry: dict | None) -> None:
        """Apply one record of the residency changelog: ``entry`` is the decoded ``residency`` value (schemas
        residency_v1..v3), or None for a tombstone (the key left the table).

        Rows with ``copies > 0`` become the holders of (ownership, block); the entry's ``parent_block_hash`` and
        ``content_hash`` (residency v3) link the block into the content walk, and are kept when an entry
        carries none (a tokenless offload store of another ownership inherits them). The same as
        :meth:`apply_rows` of the entry's part the index keeps (:func:`~stream_apps.index.entry_reader.index_entry_of`).

        Raises:
            ValueError: a key that is not ``<ownership or primary>/<block hash hex>``.
            KeyError, TypeError: an entry that is not shaped as a residency record.
        """
        if entry is None:
            self.apply_rows(key, None)
        else:
            self.apply_rows(key, *index_entry_of(entry))

    def apply_rows(self, key: str, rows: Sequence[tuple[str, int, str]] | None, parent: bytes | None = None,
                   content: int | None = None) -> None:
        """Apply one record of the residency changelog as the feed reads it
        (:class:`~stream_apps.index.entry_reader.IndexEntryReader`), without the entry's dicts.

        Args:
            key: the record's key, ``<ownership or primary>/<block hash hex>``.
            rows: ``(instance_id, data_parallel_rank, tier)`` of each row with ``copies > 0`` (repeats count once),
                the holders of (ownership, block) from now on; None for a tombstone (the key left the table).
            parent: the entry's ``parent_block_hash`` (canonical hash bytes), or None: keep the block's.
            content: the entry's ``content_hash`` (signed 64-bit), or None: keep the block's.

        Raises:
            ValueError: a key that is not ``<ownership or primary>/<block hash hex>``.
        """
        ownership, block_hash = _parse_key(key)
        with self.lock:
            self.counters.entries_applied += 1
            block = block_key(block_hash)
            scope = self._scope(ownership)
            if rows is None:
                self._table.replace(block, scope, (), None, None)
                self.fresh.after_changelog((key.encode(),), self._scopes)
                return
            known = self._row_holders.get(ownership)
            if known is None:
                known = self._row_holders[ownership] = {}
            try:
                holders = [known[row] for row in rows]  # in any order, repeats too: the table sorts them
            except KeyError:  # a holder not seen before (the first entries of a catch-up hold them all)
                for row in rows:
                    if row not in known:
                        known[row] = self._holder_id(HolderInfo(*row, ownership))
                holders = [known[row] for row in rows]
            self._table.replace(block, scope, holders, None if parent is None else block_key(parent),
                                None if content is None else content & _U64)
            self.fresh.after_changelog((key.encode(),), self._scopes)

    def apply_messages(self, messages: Sequence, positions: dict[int, int],
                       read: Callable[[bytes], tuple]) -> tuple[list[tuple[object, Exception]], list]:
        """The feed's step (:class:`~stream_apps.index.feed.ChangelogFeed`) over one ``consume()`` of the
        residency changelog, under one hold of the lock: every message without an error moves its partition's
        position, and every one with a key is applied as :meth:`apply_changelog` applies a record.

        A worker's feed reads back every record its agent writes, on the agent's event loop, so the compiled
        table runs this loop in C (``BlockTable.apply_messages``); :meth:`_apply_messages_python` is the
        reference, for the pure-Python table, and the tests compare the two.

        Args:
            messages: confluent-kafka ``Message`` objects, in the order consumed.
            positions: partition -> next offset to read; updated.
            read: the value reader, as :meth:`apply_changelog` takes it.

        Returns:
            ``(failures, errors)``: ``(message, error)`` of each record not applied (a key that is not
            ``<ownership>/<block hash hex>``, a value ``read`` refused), and the messages that carry an error
            (``message.error()``: the caller logs them; partition EOF among them).
        """
        compiled = getattr(self._table, "apply_messages", None)
        with self.lock:
            if compiled is None:
                applied, failures, errors = self._apply_messages_python(messages, positions, read)
            else:
                applied, failures, errors = compiled(messages, positions, read, self._scopes, self._row_holders,
                                                     self._scope, self._new_row_holder)
            self.counters.entries_applied += applied
            if self.fresh.wants_changelog:
                self.fresh.after_changelog([m.key() for m in messages if m.error() is None], self._scopes)
        return failures, errors

    def _apply_messages_python(self, messages: Sequence, positions: dict[int, int],
                               read: Callable[[bytes], tuple]) -> tuple[int, list, list]:
        """:meth:`apply_messages`'s loop in Python (the lock held): ``(applied, failures, errors)``."""
        errors, keyed = [], []
        for message in messages:
            if message.error() is not None:
                errors.append(message)
                continue
            positions[message.partition()] = message.offset() + 1
            if message.key() is not None:
                keyed.append(message)
        applied, failures = self._apply_records([(m.key(), m.value()) for m in keyed], read)
        return applied, [(keyed[position], exc) for position, exc in failures], errors

    def _new_row_holder(self, ownership: str | None, row: tuple[str, int, str]) -> int:
        """The holder id of ``row`` of ``ownership``'s entries, made and remembered (the compiled feed loop's
        call for a row it has no id for)."""
        self._row_holders[ownership][row] = holder = self._holder_id(HolderInfo(*row, ownership))
        return holder

    def apply_changelog(self, records: Iterable[tuple[bytes, bytes | None]],
                        read: Callable[[bytes], tuple]) -> list[tuple[int, Exception]]:
        """Apply residency changelog records in order, as :meth:`apply_rows` applies each one, in one call and
        under one hold of the lock.

        The same steps as :meth:`apply_rows`, written out in the loop: a Python call per record and step cost
        about a third of what the feed spends per record, and a worker's feed reads every record its agent writes.

        Args:
            records: ``(key bytes, value bytes)``; an empty or None value is a tombstone.
            read: the value reader, ``value -> (rows, parent, content)`` as :meth:`apply_rows` takes them
                (:meth:`~stream_apps.index.entry_reader.IndexEntryReader.read_index_entry`).

        Returns:
            ``(position in records, error)`` of each record not applied (a key that is not ``<ownership>/<block
            hash hex>``, or a value ``read`` refused); the others are applied.
        """
        records = list(records)
        with self.lock:
            applied, failures = self._apply_records(records, read)
            self.counters.entries_applied += applied
            if self.fresh.wants_changelog:
                self.fresh.after_changelog([key for key, _ in records], self._scopes)
        return failures

    def _apply_records(self, records: Iterable[tuple[bytes, bytes | None]],
                       read: Callable[[bytes], tuple]) -> tuple[int, list[tuple[int, Exception]]]:
        """:meth:`apply_changelog`'s loop (the lock held): ``(applied, failures)``."""
        failures = []
        replace, key_block = self._table.replace, residency_key_block
        row_holders, scopes = self._row_holders, self._scopes
        applied = 0
        for position, (key, value) in enumerate(records):
            try:
                ownership, block = key_block(key)
                rows, parent, content = read(value) if value else (None, None, None)
                scope = scopes.get(ownership)
                if scope is None:
                    scope = self._scope(ownership)
                if rows is None:
                    replace(block, scope, (), None, None)
                    applied += 1
                    continue
                known = row_holders.get(ownership)
                if known is None:
                    known = row_holders[ownership] = {}
                try:
                    holders = [known[row] for row in rows]
                except KeyError:  # a holder not seen before
                    for row in rows:
                        if row not in known:
                            known[row] = self._holder_id(HolderInfo(*row, ownership))
                    holders = [known[row] for row in rows]
                replace(block, scope, holders, None if parent is None else block_key(parent),
                        None if content is None else content & _U64)
                applied += 1
            except (ValueError, KeyError, TypeError, OverflowError) as exc:  # DecodeError is a ValueError
                failures.append((position, exc))
        return applied, failures

    def apply_registration(self, instance_id: str, info: SourceInfo | None) -> None:
        """Apply one record of ``kv-instances`` (:mod:`stream_apps.index.registrations`): ``info`` becomes the
        instance's registration, or None (a tombstone) forgets it."""
        with self.lock:
            if info is None:
                self.sources.unregister(instance_id)
            else:
                self.sources.put(info)

    def clear(self) -> None:
        """Forget every block (the feed starts over)."""
        with self.lock:
            self._table.clear()
            self.fresh = FreshLayer(self._table, self._scope, self._scope_owners.__getitem__, self._holder_id,
                                    self._holders, self.fresh.window_s)

    # -- lookups ---------------------------------------------------------------------------------------------

    def holders_at(self, chain: Sequence[bytes]) -> list[tuple[int, ...]]:
        """Holder ids of each block of ``chain`` (canonical block hashes), up to the first block nobody holds."""
        keys = [block_key(h) for h in chain]
        with self.lock:
            return self._table.holders_at(keys)

    def holder(self, holder_id: int) -> HolderInfo:
        """The identity behind a holder id."""
        return self._holders[holder_id]

    def _allowed(self, model_name: str | None, tenant_id: str | None, block_size: int | None) -> bytes | None:
        """The holder filter of one query: the model, tenant and block size asked for, and no source that is
        down (its lease lapsed: :mod:`stream_apps.index.liveness`). None when every holder counts, else one byte
        per holder id (non-zero: counted), the filter :func:`~stream_apps.index.scoring.table_prefix_runs`
        hands the compiled table without a call back per holder. Kept per (model, tenant, block size) until a
        registration, a new holder or a lease changes it."""
        sources = self.sources
        down = self.leases.down() if self.leases is not None else frozenset()
        if (model_name is None and tenant_id in (None, DEFAULT_TENANT) and block_size is None and not len(sources)
                and not down):
            return None  # nothing registered, nothing asked, nobody down: every holder counts (the fast path)
        key = (model_name, tenant_id, block_size)
        stamp = (sources.version, len(self._holders), down)
        cached = self._verdict_cache.get(key)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        verdict: dict[tuple[str, int], bool] = {}
        flags = bytearray(len(self._holders))
        for holder_id, info in enumerate(self._holders):
            source = (info.instance_id, info.data_parallel_rank)
            counted = verdict.get(source)
            if counted is None:
                counted = verdict[source] = source not in down and sources.matches(
                    info.instance_id, model_name, tenant_id) and (
                    block_size is None or sources.block_size(info.instance_id) == block_size)
            flags[holder_id] = counted
        if len(self._verdict_cache) >= 256:  # one entry per model and tenant asked for; bounded all the same
            self._verdict_cache.clear()
        verdicts = bytes(flags)
        self._verdict_cache[key] = (stamp, verdicts)
        return verdicts

    def _block_sizes(self, model_name: str | None, tenant_id: str | None) -> list[int]:
        """The block sizes of the instances a query for ``model_name`` of ``tenant_id`` may name, ascending; kept
        until a registration or a new holder changes them (a scan of every holder per query would cost more than
        the lookup in a fleet of thousands)."""
        key = (model_name, tenant_id)
        stamp = (self.sources.version, len(self._holders))
        cached = self._size_cache.get(key)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        sizes = sorted({self.sources.block_size(info.instance_id) for info in self._holders
                        if self.sources.matches(info.instance_id, model_name, tenant_id)})
        if len(self._size_cache) >= 256:
            self._size_cache.clear()
        self._size_cache[key] = (stamp, sizes)
        return sizes

    def prefix_match(self, chain: Sequence[bytes]) -> list[dict]:
        """``POST /prefix-match/``'s ``matches`` for a chain of engine block hashes (prefix order)."""
        with self.lock:
            # the walk and its scoring in one call of the table (compiled: in C)
            runs = table_prefix_runs(self._table, block_keys(chain), self._holders, self.weights,
                                     self._allowed(None, None, None))
        return prefix_match_rows(runs)

    def query_hashes(self, chain: Sequence[bytes], model_name: str | None = None, tenant_id: str | None = None,
                     ) -> dict:
        """Mooncake's ``/query_by_hash`` answer for a chain of the engines' own block hashes: per instance the
        longest held prefix in tokens (each instance's own block size), per tier class and per rank."""
        with self.lock:
            runs = table_prefix_runs(self._table, block_keys(chain), self._holders, self.weights,
                                     self._allowed(model_name, tenant_id, None))
            return instances_answer(runs, self.sources.block_size)

    def query_tokens(self, token_ids: Sequence[int] | bytes, *, block_size: int | None = None,
                     lora_name: str | None = None, cache_salt: str | None = None, model_name: str | None = None,
                     tenant_id: str | None = None) -> dict:
        """Mooncake's and Dynamo's ``/query`` answer for a prompt's token ids (docs/querying.md).

        Args:
            token_ids: the prompt's token ids, or their little-endian u32 (or int32) bytes.
            block_size: tokens per block; None: every block size the candidate instances have (each instance is
                matched with its own).
            lora_name, cache_salt: as the engine got them; they change the blocks' content hashes as vLLM's
                extra keys change its block hashes, so the same tokens under another salt match nothing salted.
            model_name: only instances serving this model (or of unknown model); None: any.
            tenant_id: Mooncake's tenant namespace; None: ``default``.

        Returns:
            ``{"instances": {...}, "scores": {...}, "kvstream": {...}}`` (:func:`instances_answer`).

        Raises:
            ValueError: a block size below 1, or token bytes whose length is not a multiple of 4.
        """
        data = token_ids if isinstance(token_ids, bytes) else token_bytes(token_ids)
        with self.lock:
            sizes = [block_size] if block_size is not None else self._block_sizes(model_name, tenant_id)
            runs: dict[tuple[str, int], PrefixRun] = {}
            for size in sizes:
                contents = block_content_digests(data, size, lora_name, cache_salt)
                if self._table.content_mixed(contents):
                    self._note_mixed_hashes(self._table.content_walk_blocks(contents))
                for key, run in table_prefix_runs(self._table, contents, self._holders, self.weights,
                                                  self._allowed(model_name, tenant_id, size), by_content=True).items():
                    if key not in runs or run.any > runs[key].any:
                        runs[key] = run
            self._check_hash_profiles(runs, data, lora_name, cache_salt)
            return instances_answer(runs, self.sources.block_size)

    def _check_hash_profiles(self, runs, token_ids, lora_name, cache_salt) -> None:
        """The first time a query by tokens matches an instance with a recomputable hash profile, recompute its
        engine hashes of the matched prefix (Mooncake's conductor does this for every query; once is enough to
        tell a misconfigured source) and check that the instance holds block 0 under that hash."""
        for (instance, _), run in runs.items():
            info = self.sources.get(instance)
            if info is None or info.hash_profile is None or info.hash_profile_ok is not None or not run.any:
                continue
            profile = HashProfile.parse(info.hash_profile)
            if not profile.recomputable:
                continue
            size = self.sources.block_size(instance)
            tokens = token_ids if not isinstance(token_ids, bytes) else list(memoryview(token_ids).cast("i"))
            expected = engine_block_hashes(profile, list(tokens[:size]), size, lora_name, cache_salt)
            held = self._table.holders_at([block_key(h) for h in expected[:1]])
            info.hash_profile_ok = bool(held) and any(self._holders[h].instance_id == instance for h in held[0])

    def _note_mixed_hashes(self, blocks: list[tuple[int, ...]]) -> None:
        self.counters.mixed_hash_queries += 1
        if len(self.counters.mixed_hash_instances) < 16:
            deepest = next(candidates for candidates in blocks if len(candidates) > 1)
            instances = sorted({self._holders[h].instance_id for h in self._table.holders_at(list(deepest[:1]))[0]}
                               | {self._holders[h].instance_id for b in deepest[1:]
                                  for h in self._table.holders_at([b])[0]})
            if instances not in self.counters.mixed_hash_instances:
                self.counters.mixed_hash_instances.append(instances)

    # -- fleet views -----------------------------------------------------------------------------------------

    def workers(self) -> list[dict]:
        """``GET /workers``: every (instance, data-parallel rank) the index holds blocks of, or that registered,
        with its resident blocks per tier (and per ownership of each tier), its registered metadata and its
        liveness (``live``, ``last_heard``, ``down_since``: seconds since the Unix epoch, the workers' clock)."""
        with self.lock:
            per_source: dict[tuple[str, int], Counter] = {}
            for holder_id, info in enumerate(self._holders):
                count = self._table.holder_blocks(holder_id)
                if count:
                    tiers = per_source.setdefault((info.instance_id, info.data_parallel_rank), Counter())
                    tiers[(info.tier, info.ownership)] += count
            for info in self.sources.all():
                for rank in info.dp_ranks or {0}:
                    per_source.setdefault((info.instance_id, rank), Counter())
            states = self.leases.states() if self.leases is not None else {}
            rows = []
            for (instance, rank), tiers in sorted(per_source.items()):
                registered = self.sources.get(instance)
                state = states.get((instance, rank))
                blocks: Counter = Counter()
                for (tier, _), n in tiers.items():
                    blocks[tier] += n
                rows.append({
                    "instance_id": instance, "data_parallel_rank": rank, "blocks": dict(sorted(blocks.items())),
                    "blocks_by_ownership": [{"tier": tier, "ownership": own, "blocks": n}
                                            for (tier, own), n in sorted(tiers.items(), key=lambda i: (i[0][0],
                                                                                                       i[0][1] or ""))],
                    "registered": registered is not None,
                    "model_name": registered.model_name if registered else None,
                    "block_size": self.sources.block_size(instance),
                    "tenant_id": registered.tenant_id if registered else DEFAULT_TENANT,
                    "hash_profile_ok": registered.hash_profile_ok if registered else None,
                    "live": None if state is None else state.live,  # None: no lease seen (e.g. unregistered)
                    "last_heard": None if state is None else round(state.last_heard, 3),
                    "down_since": None if state is None or state.down_since is None else round(state.down_since, 3),
                })
            return rows

    def stats(self) -> dict:
        """Size and counters: ``{"blocks", "holders", "resident_pairs", "memory_bytes", "entries_applied",
        "mixed_hash_queries", "mixed_hash_instances"}``."""
        with self.lock:
            return {"blocks": len(self._table), "holders": len(self._holders), "resident_pairs": self._table.links,
                    "memory_bytes": self._table.memory_bytes(), "entries_applied": self.counters.entries_applied,
                    "mixed_hash_queries": self.counters.mixed_hash_queries,
                    "mixed_hash_instances": list(self.counters.mixed_hash_instances)}

    def dump(self, batch: int = 4096) -> Iterator[dict]:
        """``GET /dump``: every block, its parent and content hash and its holders, one dict per block.

        The lock is taken per ``batch`` blocks, so a dump of a large index does not stall the feed or the
        queries; blocks changed meanwhile may show either value.
        """
        with self.lock:
            items = list(self._table.items())
        for start in range(0, len(items), batch):
            with self.lock:
                holders = self._holders
                for block, parent, content, pairs in items[start:start + batch]:
                    yield {"block_hash": f"{block:016x}", "parent_block_hash": None if parent is None else
                           f"{parent:016x}", "content_hash": None if content is None else
                           (content - (1 << 64) if content >> 63 else content),
                           "holders": [{"instance_id": holders[h].instance_id,
                                        "data_parallel_rank": holders[h].data_parallel_rank,
                                        "tier": holders[h].tier, "ownership": holders[h].ownership}
                                       for _, h in pairs]}
