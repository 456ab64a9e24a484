"""Content hashes of KV blocks: a key of a block's own tokens that does not depend on the engine's hash seed.

An engine's block hashes are seeded and salted (vLLM's ``NONE_HASH`` comes from ``PYTHONHASHSEED`` and is random
when it is unset; its default ``sha256`` hashes pickled tuples, which only Python reproduces), so a router that
has token ids cannot compute them. The read path therefore keeps a *dual key* (docs/querying.md, "For router
authors"), as llm-d, Dynamo and Mooncake's indexer do:

* each stored block gets a **content hash** here, from its own tokens and extra keys alone (stateless, so every
  producer computes it per event): XXH3-64, seed 0, over the block's token ids as little-endian u32, followed by
  the msgpack encoding of the block's extra keys when it has any. It is Mooncake's and Dynamo's "local hash";
* the index chains content hashes along the engine's parent hashes, so a prefix of token blocks is found whatever
  seed the engines run with (``stream_apps.index``).

Extra keys are what vLLM 0.33 puts in each block's ``extra_keys`` entry: ``[lora_name]`` on every block of a LoRA
request, then ``cache_salt`` on block 0 of a salted request (``vllm/v1/core/kv_cache_utils.py``). A query with
``token_ids``, ``lora_name`` and ``cache_salt`` builds the same keys with :func:`query_extra_keys`, so the same
tokens under another salt, or without it, match nothing salted.

A vLLM store without ``extra_keys`` does not say its extra keys: vLLM's GPU block pool always sends the field (an
entry per block, None for a block without keys), and the salt and LoRA name of the request went into the engine's
block hash, not into the event. A store of another publisher (the offloading connector's ``OffloadingEventsTracker``,
a secondary tier) that omits it may hold a salted or LoRA block, so its tokens alone do not give its content hash:
:func:`stored_content_hash` gives None, and the producer takes the content known for the same engine hash instead
(``producers.split.ParentTracker``). SGLang never sends ``extra_keys``: its ``lora_name`` and ``cache_salt`` fields
say them.

The value is a signed 64-bit int (Avro ``long``): the digest's bits as two's complement.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence
from typing import Any

import msgspec
import xxhash

_ENCODE_MSGPACK = msgspec.msgpack.Encoder().encode
_XXH3 = xxhash.xxh3_64_intdigest
_LITTLE_ENDIAN = sys.byteorder == "little"
_SIGN = 1 << 63
_U64 = 1 << 64
_U32 = (1 << 32) - 1


def _signed(digest: int) -> int:
    return digest - _U64 if digest >= _SIGN else digest


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """``token_ids`` as little-endian u32, the bytes a content hash covers (a negative id wraps to its u32 bits,
    as the engines' int32 ids do).

    Raises:
        OverflowError: a token id outside the 32-bit range.
    """
    try:
        packed = array.array("I", token_ids)
    except OverflowError:
        packed = array.array("I", [t & _U32 if -(1 << 31) <= t < 0 else t for t in token_ids])
    if not _LITTLE_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def content_hash(token_ids: Sequence[int] | bytes, extra_keys: Sequence | None = None) -> int:
    """The content hash of one block: XXH3-64 (seed 0) over its tokens as little-endian u32, then the msgpack
    encoding of ``extra_keys`` when it is not empty.

    Args:
        token_ids: the block's token ids, or their little-endian u32 bytes (:func:`token_bytes`).
        extra_keys: the block's extra keys as vLLM orders them (LoRA name, multimodal identifiers, cache salt);
            None or empty for a block without any.

    Returns:
        A signed 64-bit int.
    """
    data = token_ids if isinstance(token_ids, bytes) else token_bytes(token_ids)
    if extra_keys:
        data += _ENCODE_MSGPACK(list(extra_keys))
    return _signed(_XXH3(data))


def query_extra_keys(block_index: int, lora_name: str | None = None, cache_salt: str | None = None) -> list | None:
    """The extra keys vLLM 0.33 gives block ``block_index`` of a request (``_gen_lora_extra_hash_keys`` and
    ``_gen_cache_salt_extra_hash_keys``): ``[lora_name]`` on every block of a LoRA request, then ``cache_salt``
    on block 0. None when there are none."""
    keys = []
    if lora_name:
        keys.append(lora_name)
    if cache_salt and block_index == 0:
        keys.append(cache_salt)
    return keys or None


def block_content_digests(token_ids: Sequence[int] | bytes, block_size: int, lora_name: str | None = None,
                          cache_salt: str | None = None) -> list[int]:
    """:func:`block_content_hashes` as unsigned 64-bit ints (the XXH3 digests themselves): the keys the fleet
    index's content walk takes, without a sign round trip per block.

    Raises:
        ValueError: as :func:`block_content_hashes`.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, not {block_size}")
    data = token_ids if isinstance(token_ids, bytes) else token_bytes(token_ids)
    if len(data) % 4:
        raise ValueError(f"token bytes of length {len(data)}: expected little-endian u32, 4 bytes per token")
    step = 4 * block_size
    blocks = len(data) // step
    if not lora_name and not cache_salt:  # no extra keys: the tokens alone (the common request)
        return [_XXH3(data[i * step:(i + 1) * step]) for i in range(blocks)]
    digests = []
    for i in range(blocks):
        block = data[i * step:(i + 1) * step]
        keys = query_extra_keys(i, lora_name, cache_salt)
        digests.append(_XXH3(block + _ENCODE_MSGPACK(keys) if keys else block))
    return digests


def block_content_hashes(token_ids: Sequence[int] | bytes, block_size: int, lora_name: str | None = None,
                         cache_salt: str | None = None) -> list[int]:
    """The content hashes of a request's full blocks, as a query computes them (signed 64-bit ints, as
    :func:`content_hash` gives them).

    Args:
        token_ids: the prompt's token ids, or their little-endian u32 bytes (as Mooncake's proxy sends them).
        block_size: tokens per block; a trailing partial block is not hashed (engines publish full blocks only).

    Raises:
        ValueError: ``block_size`` below 1, or bytes whose length is not a multiple of 4.
    """
    return [_signed(d) for d in block_content_digests(token_ids, block_size, lora_name, cache_salt)]


_DECODE_MSGPACK = msgspec.msgpack.Decoder().decode


def stored_extra_keys(entry: Any, has_extra_keys: bool, lora_name: str | None = None, cache_salt: str | None = None,
                      first_of_chain: bool = False) -> list | None:
    """The extra keys a producer hashes with one stored block's tokens (``kv_event`` v4 ``BlockStored.content_hash``).

    Args:
        entry: the block's entry of the event's ``extra_keys`` (ignored when ``has_extra_keys`` is false).
        has_extra_keys: whether the event carried ``extra_keys`` at all (vLLM does; SGLang never does).
        lora_name, cache_salt: the store's LoRA name and cache salt (None: none).
        first_of_chain: the block is the first of its chain: block 0 of an event whose ``parent_block_hash`` is None.

    Returns:
        With ``extra_keys``, the entry's keys: None for a None or empty entry, a list or tuple's items, any other
        value alone. Without (SGLang): ``[lora_name]`` for a LoRA store, then ``cache_salt`` on the first block of a
        chain, in vLLM's order (:func:`query_extra_keys`, so a query with the same LoRA name and salt matches).
        None when there are none. A vLLM store without ``extra_keys`` says no keys at all (:func:`says_extra_keys`):
        its callers give it no content hash rather than these.
    """
    if has_extra_keys:
        if entry is None:
            return None
        return (list(entry) or None) if isinstance(entry, (list, tuple)) else [entry]
    return query_extra_keys(0 if first_of_chain else 1, lora_name, cache_salt)


#: The engines whose rule :func:`stored_content_hash` applies, as ``producers.engine_events.Publisher.engine`` names
#: them.
ENGINES = ("vllm", "sglang")


def record_engine(hash_encoding: str | None) -> str:
    """The engine a ``kv_event`` record comes from, as far as its content rule goes, from its ``hash_encoding``:
    ``sglang`` for ``INT64`` (SGLang's signed 64-bit hashes), else ``vllm`` (its unsigned ints and its digests, the
    rule ``producers.rebuild`` uses too). A record of byte digests is read as vLLM's."""
    return "sglang" if hash_encoding == "INT64" else "vllm"


def says_extra_keys(has_extra_keys: bool, engine: str) -> bool:
    """Whether a store says its blocks' extra keys: with ``extra_keys`` (vLLM), or always for SGLang, whose
    ``lora_name`` and ``cache_salt`` fields say them. A vLLM store without ``extra_keys`` (the offloading connector's,
    a secondary tier's, a release before the field) does not: vLLM's salt and LoRA name went into the engine's block
    hash, so its tokens alone are not its content (module docstring).

    Raises:
        ValueError: an engine other than :data:`ENGINES`.
    """
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r} (expected one of {', '.join(ENGINES)})")
    return has_extra_keys or engine == "sglang"


def stored_content_hash(body: dict, engine: str) -> int | None:
    """The content hash of a decoded ``kv_event`` BlockStored body, by the producers' rule (:func:`stored_extra_keys`),
    without what a producer remembers: for records that lack one (written by a v1-v3 producer, or whose producer did
    not know the content). A field an older version lacks reads as None.

    Args:
        body: the BlockStored body (``token_ids``, ``extra_keys`` as msgpack bytes or None, ``lora_name``,
            ``cache_salt``, ``parent_block_hash``; absent ones read as None).
        engine: ``vllm`` or ``sglang``: :func:`record_engine` of the record's ``hash_encoding``.

    Returns:
        A signed 64-bit int; None for a body without token ids (nothing to hash), whose ``extra_keys`` is not
        msgpack (its keys are unknown), or that does not say its extra keys (a vLLM store without ``extra_keys``:
        :func:`says_extra_keys`).

    Raises:
        ValueError: an unknown engine.
    """
    tokens = body["token_ids"]
    raw = body.get("extra_keys")
    if not says_extra_keys(raw is not None, engine) or not tokens:
        return None
    try:
        entry = None if raw is None else _DECODE_MSGPACK(raw)
    except msgspec.DecodeError:
        return None
    return content_hash(tokens, stored_extra_keys(entry, raw is not None, body.get("lora_name"),
                                                  body.get("cache_salt"), body.get("parent_block_hash") is None))
