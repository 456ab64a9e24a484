"""The Mooncake request trace the simulator replays: reading it (:func:`load_trace`, :data:`DEFAULT_TRACE`,
:class:`Request`) and what its block ids stand for.

The trace gives block ids, not tokens. Each trace block's 512 tokens are derived from its id
(:func:`trace_block_tokens`), so tests, the demo and the bench can query by token ids
(:func:`trace_request_tokens`); the simulated GPU stores carry each block's content hash computed from them, not the
tokens (:func:`trace_block_content_hash`). A block id's vLLM-style block hash is :func:`block_hash_of`.
"""

from __future__ import annotations

import array
import gzip
import hashlib
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from schemas.content_hash import content_hash

#: The vendored Mooncake conversation trace (see producers/data/README.md).
DEFAULT_TRACE = Path(__file__).resolve().parent / "data" / "mooncake_conversation_trace.jsonl.gz"

#: Tokens per block of the Mooncake trace's hash ids: the block size the simulated engines declare in their stores,
#: and the size :func:`trace_request_tokens` splits into blocks.
TRACE_BLOCK_SIZE = 512

#: Vocabulary of the simulated model: 151,936 token ids (Qwen2's), 0 to 151,935. :func:`trace_block_tokens`
#: draws from its first 2**17 (131,072) ids.
TRACE_VOCAB_SIZE = 151_936
_TOKEN_BITS = 17
#: Keeps the lowest bit of a token's third byte: with the two bytes below it, a 17-bit token id.
_LOWEST_BIT = bytes(b & 1 for b in range(256))
_ZEROS = bytes(TRACE_BLOCK_SIZE)

_U64 = (1 << 64) - 1


@dataclass(frozen=True)
class Request:
    """One request of the trace."""

    #: Arrival time in milliseconds from the start of the trace.
    timestamp_ms: int
    #: The prompt's block ids, in prefix order (one per 512 tokens).
    hash_ids: tuple[int, ...]


def load_trace(path: Path = DEFAULT_TRACE, limit: int | None = None) -> list[Request]:
    """Read a Mooncake-format trace (JSONL, optionally gzipped).

    Args:
        limit: keep only the first ``limit`` requests.

    Raises:
        ValueError: a line is not a JSON object with ``timestamp`` and ``hash_ids``
            (the message names the line).
    """
    opener = gzip.open if str(path).endswith(".gz") else open
    requests = []
    with opener(path, "rt") as lines:
        for number, line in enumerate(lines, 1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                requests.append(Request(int(row["timestamp"]), tuple(int(h) for h in row["hash_ids"])))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: not a trace request ({exc})") from None
    return requests


def block_hash_of(hash_id: int) -> int:
    """The vLLM-style block hash (unsigned 64-bit int) of a trace block id.

    A splitmix64 finalizer: distinct ids give distinct, well-spread hashes over
    the whole u64 range (so half of them are >= 2**63, as vLLM's are).
    """
    z = (hash_id + 0x9E3779B97F4A7C15) & _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return z ^ (z >> 31)


def _trace_block_bytes(hash_id: int) -> bytes:
    """The 512 tokens of trace block ``hash_id`` as little-endian u32 (see :func:`trace_block_tokens`)."""
    if not 0 <= hash_id <= _U64:
        raise ValueError(f"trace block id {hash_id} is outside 0..2**64-1")
    stream = hashlib.shake_128(hash_id.to_bytes(8, "little")).digest(3 * TRACE_BLOCK_SIZE)
    # byte slices, not a loop over 512 ints: a block costs microseconds, and the bench simulates millions
    tokens = bytearray(4 * TRACE_BLOCK_SIZE)
    tokens[0::4] = stream[0::3]
    tokens[1::4] = stream[1::3]
    tokens[2::4] = stream[2::3].translate(_LOWEST_BIT)
    tokens[3::4] = _ZEROS
    return bytes(tokens)


def trace_block_tokens(hash_id: int) -> list[int]:
    """The 512 token ids of trace block ``hash_id`` (a Mooncake ``hash_ids`` entry), the same on every call and
    every machine.

    The trace records which blocks requests share, not their tokens; these stand in for them. The tokens are
    the SHAKE-128 output stream of the id as 8 little-endian bytes, 3 bytes per token, each 3 bytes read as a
    little-endian integer and kept to its lowest 17 bits: token ids 0 to 131,071 (2**17 - 1), all valid ids of
    the simulated 151,936-token vocabulary (:data:`TRACE_VOCAB_SIZE`). Any other language derives the same
    tokens from those three lines.

    Raises:
        ValueError: ``hash_id`` outside 0..2**64-1.
    """
    tokens = array.array("I")
    tokens.frombytes(_trace_block_bytes(hash_id))
    if sys.byteorder != "little":
        tokens.byteswap()
    return tokens.tolist()


def trace_request_tokens(request: Request | Sequence[int]) -> list[int]:
    """The token ids of a trace request's prompt: its blocks' tokens (:func:`trace_block_tokens`) concatenated in
    prefix order, 512 per block. The trace has whole blocks only, so every block is full: a query with these
    tokens and block size 512 computes the content hashes the simulated stores carry.

    Args:
        request: a :class:`Request`, or its ``hash_ids``.

    Raises:
        ValueError: a block id outside 0..2**64-1.
    """
    hash_ids = request.hash_ids if isinstance(request, Request) else request
    tokens: list[int] = []
    for hash_id in hash_ids:
        tokens += trace_block_tokens(hash_id)
    return tokens


def trace_block_content_hash(hash_id: int) -> int:
    """The content hash (``BlockStored.content_hash``, schemas.content_hash) of trace block ``hash_id``: of its
    512 tokens (:func:`trace_block_tokens`), without extra keys (the simulated requests have no LoRA and no salt).

    The simulated GPU stores publish this instead of their tokens, in the event's
    :data:`producers.split.CONTENT_HASHES` (``token_ids`` stays empty): 512 tokens would add about 1.5 KB to every
    block event (Avro varints of ids up to 2**17), several times the rest of the record, for a pipeline that
    needs only the hash. The offload stores stay placeholders without tokens or content hash, as vLLM's
    offloading connector publishes them.

    Raises:
        ValueError: ``hash_id`` outside 0..2**64-1.
    """
    return content_hash(_trace_block_bytes(hash_id))
