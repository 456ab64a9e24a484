"""vLLM's own block hashes, recomputed from token ids with a registered hash profile.

A router that registers an engine with Mooncake's conductor (``POST /register``) sends a ``hash_profile``::

    {"strategy": "vllm_v1", "algorithm": "sha256" | "sha256_cbor", "python_hash_seed": "<decimal>" | "random",
     "index_projection": "low64_be"}

With it the engine's block hashes can be recomputed from a request's token ids, so a query can be answered with
the very keys the engine publishes in its KV events (the dual key's other half, next to
:mod:`schemas.content_hash`). The recipe mirrors vLLM v1:

* ``vllm/utils/hashing.py``: ``H`` is ``sha256`` (SHA-256 of ``pickle.dumps(obj, protocol=HIGHEST_PROTOCOL)``, the
  default), ``sha256_cbor`` (SHA-256 of ``cbor2.dumps(obj, canonical=True)``), ``xxhash`` (XXH3-128 of the same
  pickle) or ``xxhash_cbor`` (XXH3-128 of the same CBOR). The digest is 32 bytes, or 16 for the XXH3 pair.
* ``vllm/v1/core/kv_cache_utils.py``:

  - ``init_none_hash``: the chain's root, ``NONE_HASH = H(seed)``, the hash of the seed *text* (so ``"0"`` and
    ``"00"`` are different roots);
  - ``generate_block_hash_extra_keys`` / ``_gen_lora_extra_hash_keys``: a block's extra keys are
    ``(lora_name,)`` on every block of a LoRA request, then ``cache_salt`` on block 0 only, or None when there
    are none (multimodal and prompt-embedding keys are not expressible here, as in Mooncake's query contract);
  - ``hash_block_tokens``: ``H((parent_digest, tuple(block_tokens), extra_keys))``, chained on the parent's
    *full* digest (the root for block 0);
  - ``get_request_block_hasher``: full blocks only; a trailing partial block has no hash.
* ``maybe_convert_block_hash`` (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, the default): the published hash is the
  digest's low 64 bits read big-endian, the ``low64_be`` projection; as kvstream's canonical block hash
  (:func:`schemas.block_hash.canonical_block_hash` of that int) these are the digest's last 8 bytes.

Why a random seed cannot be recomputed: when ``PYTHONHASHSEED`` is unset, vLLM makes the root from
``os.urandom(32)``, fresh in every process and never published, and every block hash chains from it. A profile
whose seed is ``"random"`` therefore has ``recomputable`` False; such engines are matched by content hashes only.
(Mooncake's conductor instead hashes the text ``"random"`` as the seed, which matches an engine only if its
``PYTHONHASHSEED`` is literally ``random``. kvstream reads ``"random"`` as "not fixed", the case the conductor's
own README says cannot be reconstructed, rather than guess a root.)

vLLM changed the unset-seed case in August 2026 (vllm-project/vllm PR #51875): with ``sha256`` and
``sha256_cbor`` the root is now ``H("vllm-none-hash")``, and only the XXH3 algorithms keep a per-process random
seed (``H(os.urandom(32).hex())``). Such an engine can be described with ``python_hash_seed``
:data:`VLLM_DEFAULT_SEED`, a kvstream extension (Mooncake's conductor accepts only decimal seeds and
``"random"``). The profile cannot tell an engine older than that change from a newer one, so ``"random"`` stays
not recomputable.
"""

from __future__ import annotations

import hashlib
import operator
import pickle
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import cbor2
import xxhash

#: The only hash strategy: vLLM v1's chained block hashes.
STRATEGY = "vllm_v1"
#: vLLM's ``--prefix-caching-hash-algo`` values that can be recomputed here.
ALGORITHMS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
#: The only index projection: the digest's low 64 bits, big-endian (vLLM's int block hashes).
PROJECTIONS = ("low64_be",)
#: The profile's word for an engine started without a fixed ``PYTHONHASHSEED``.
RANDOM_SEED = "random"
#: The seed vLLM hashes when ``PYTHONHASHSEED`` is unset and the algorithm is sha256 or sha256_cbor (PR #51875).
VLLM_DEFAULT_SEED = "vllm-none-hash"
#: The largest ``PYTHONHASHSEED`` CPython accepts (it refuses to start with a larger one).
MAX_PYTHON_HASH_SEED = 4294967295

#: vLLM pickles with ``pickle.HIGHEST_PROTOCOL``: 5 on every CPython from 3.8 to 3.14. Pinned here so that the
#: hashes do not change with the Python that runs kvstream.
PICKLE_PROTOCOL = 5

_PROFILE_KEYS = ("strategy", "algorithm", "python_hash_seed", "index_projection")
_OPTIONAL_PROFILE_KEYS = ("root_digest",)
_SEED_RULE = f'"{RANDOM_SEED}" or ASCII decimal text in 0..{MAX_PYTHON_HASH_SEED}, e.g. "0"'


def _pickle_bytes(value: Any) -> bytes:
    return pickle.dumps(value, protocol=PICKLE_PROTOCOL)


def _cbor_bytes(value: Any) -> bytes:
    return cbor2.dumps(value, canonical=True)


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


#: algorithm -> (serializer, digest), as ``vllm/utils/hashing.py`` pairs them.
_RECIPES: dict[str, tuple[Callable[[Any], bytes], Callable[[bytes], bytes]]] = {
    "sha256": (_pickle_bytes, _sha256),
    "sha256_cbor": (_cbor_bytes, _sha256),
    "xxhash": (_pickle_bytes, xxhash.xxh3_128_digest),
    "xxhash_cbor": (_cbor_bytes, xxhash.xxh3_128_digest),
}


def _hash(algorithm: str, value: Any) -> bytes:
    serialize, digest = _RECIPES[algorithm]
    return digest(serialize(value))


def _check_algorithm(algorithm: object) -> str:
    if algorithm not in _RECIPES:
        raise ValueError(f"unsupported hash algorithm {algorithm!r} (expected one of {', '.join(ALGORITHMS)})")
    return algorithm  # type: ignore[return-value]


def _seed_type_error(seed: object) -> ValueError:
    return ValueError(f"python_hash_seed must be a string, not {type(seed).__name__} {seed!r}: the seed's text "
                      f'is hashed ("0" and "00" are different roots), so give it quoted; expected {_SEED_RULE}')


def _check_seed(seed: object, algorithm: str) -> str | None:
    """Return the seed text (None for a random seed), or raise ValueError."""
    if seed is None:
        return None
    if not isinstance(seed, str):
        raise _seed_type_error(seed)
    if seed == RANDOM_SEED:
        raise ValueError(f"python_hash_seed {RANDOM_SEED!r} is the profile's word for a random seed: construct "
                         "HashProfile with None, or read the profile with HashProfile.parse")
    if seed == VLLM_DEFAULT_SEED:
        if algorithm not in ("sha256", "sha256_cbor"):
            raise ValueError(f"python_hash_seed {VLLM_DEFAULT_SEED!r} is vLLM's default for sha256 and sha256_cbor "
                             f"only; with {algorithm} an unset PYTHONHASHSEED is random (use {RANDOM_SEED!r})")
        return seed
    if not (seed.isascii() and seed.isdigit()):
        raise ValueError(f"python_hash_seed {seed[:40]!r} is not a PYTHONHASHSEED value: expected {_SEED_RULE}")
    if int(seed) > MAX_PYTHON_HASH_SEED:
        raise ValueError(f"python_hash_seed {seed[:40]} is above {MAX_PYTHON_HASH_SEED}, the largest PYTHONHASHSEED")
    return seed


def none_hash(algorithm: str, seed: str) -> bytes:
    """vLLM's chain root for a ``PYTHONHASHSEED`` text: ``NONE_HASH = H(seed)`` (``init_none_hash``).

    The text is hashed as it is, with no validation: this is also the root vLLM takes for a literal
    ``PYTHONHASHSEED=random``. Returns the full digest (32 bytes, 16 for the XXH3 algorithms).

    Raises:
        ValueError: an unknown algorithm.
        TypeError: a seed that is not a str.
    """
    _check_algorithm(algorithm)
    if not isinstance(seed, str):
        raise TypeError(f"seed must be a str, not {type(seed).__name__}")
    return _hash(algorithm, seed)


@dataclass(frozen=True)
class HashProfile:
    """How an engine hashes its blocks: a registered ``hash_profile``, checked.

    Attributes:
        algorithm: vLLM's ``--prefix-caching-hash-algo``: ``sha256`` (vLLM's default), ``sha256_cbor``,
            ``xxhash`` or ``xxhash_cbor``.
        python_hash_seed: the engine's ``PYTHONHASHSEED`` text (decimal, 0..4294967295, kept as written), or
            :data:`VLLM_DEFAULT_SEED`; None when the engine's seed is random ("random" in the profile).
        projection: how a digest becomes the published hash; only ``low64_be``.

    Raises:
        ValueError: from the constructor, for an unknown algorithm or projection, or a bad seed.
    """

    algorithm: str
    python_hash_seed: str | None
    projection: str = "low64_be"

    def __post_init__(self) -> None:
        _check_algorithm(self.algorithm)
        if self.projection not in PROJECTIONS:
            raise ValueError(f"unsupported index projection {self.projection!r} (expected {', '.join(PROJECTIONS)})")
        _check_seed(self.python_hash_seed, self.algorithm)

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> HashProfile:
        """Read a ``hash_profile`` as Mooncake's ``POST /register`` carries it.

        Required keys: ``strategy`` (``vllm_v1``), ``algorithm``, ``python_hash_seed`` (decimal text or
        ``"random"``) and ``index_projection`` (``low64_be``). An optional ``root_digest`` (64 hex digits, as
        the conductor shows a resolved profile) must match the seed's root when the seed is fixed.

        Raises:
            TypeError: ``raw`` is not a mapping.
            ValueError: a missing or unknown key; an unknown strategy, algorithm or projection;
                a bad seed; a root_digest that is malformed or does not match.
        """
        if not isinstance(raw, Mapping):
            raise TypeError(f"hash_profile must be a mapping, not {type(raw).__name__}")
        missing = [key for key in _PROFILE_KEYS if key not in raw]
        if missing:
            raise ValueError(f"hash_profile lacks {', '.join(missing)} (it needs {', '.join(_PROFILE_KEYS)})")
        unknown = sorted(str(key) for key in raw if key not in _PROFILE_KEYS + _OPTIONAL_PROFILE_KEYS)
        if unknown:
            raise ValueError(f"hash_profile has unknown keys {', '.join(unknown)} "
                             f"(known: {', '.join(_PROFILE_KEYS + _OPTIONAL_PROFILE_KEYS)})")
        if raw["strategy"] != STRATEGY:
            raise ValueError(f"unsupported hash strategy {raw['strategy']!r} (expected {STRATEGY!r})")
        seed = raw["python_hash_seed"]
        if not isinstance(seed, str):  # null too: a profile says "random" for a random seed
            raise _seed_type_error(seed)
        profile = cls(algorithm=raw["algorithm"], python_hash_seed=None if seed == RANDOM_SEED else seed,
                      projection=raw["index_projection"])
        if "root_digest" in raw:
            profile._check_root_digest(raw["root_digest"])
        return profile

    def _check_root_digest(self, text: object) -> None:
        width = 2 * len(_hash(self.algorithm, ""))
        try:
            given = bytes.fromhex(text) if isinstance(text, str) and len(text) == width else None
        except ValueError:
            given = None
        if given is None:
            raise ValueError(f"root_digest must be {width} hex digits for {self.algorithm}, not {str(text)[:80]!r}")
        if self.recomputable and given != self.root_digest:
            raise ValueError(f"root_digest {text} is not the {self.algorithm} root of python_hash_seed "
                             f"{self.python_hash_seed!r} ({self.root_digest.hex()})")

    @property
    def recomputable(self) -> bool:
        """Whether the engine's hashes can be recomputed: False for a random seed (its root is never known)."""
        return self.python_hash_seed is not None

    @property
    def root_digest(self) -> bytes:
        """The chain's root, vLLM's ``NONE_HASH`` (full digest). Raises ValueError for a random seed."""
        return none_hash(self.algorithm, self._seed())

    def as_dict(self) -> dict[str, str]:
        """The profile as a ``hash_profile`` mapping (``"random"`` for a random seed); :meth:`parse` reads it back."""
        return {"strategy": STRATEGY, "algorithm": self.algorithm,
                "python_hash_seed": RANDOM_SEED if self.python_hash_seed is None else self.python_hash_seed,
                "index_projection": self.projection}

    def _seed(self) -> str:
        if self.python_hash_seed is None:
            raise ValueError("the engine's PYTHONHASHSEED is random: vLLM roots every block hash at os.urandom "
                             "bytes that never leave the process, so its hashes cannot be recomputed; set a fixed "
                             "PYTHONHASHSEED on the engine (and in the profile) or match by content hash")
        return self.python_hash_seed


def _tokens(token_ids: Iterable[int]) -> list[int]:
    if isinstance(token_ids, (bytes, bytearray, memoryview)):
        raise TypeError("token_ids is bytes: decode it first (Mooncake's /query sends little-endian int32, "
                        "array.array('i', data) on a little-endian host)")
    tokens = token_ids if isinstance(token_ids, list) else list(token_ids)
    if all(type(token) is int for token in tokens):
        return tokens
    checked = []
    for token in tokens:
        if isinstance(token, bool):
            raise TypeError(f"token id {token!r} is a bool, not an int")
        try:
            checked.append(operator.index(token))  # numpy ints become Python ints, which is what vLLM hashes
        except TypeError:
            raise TypeError(f"token id {token!r} is a {type(token).__name__}, not an int") from None
    return checked


def _extra_key_text(name: str, value: str | None) -> str | None:
    """None for an absent (None or empty) key; otherwise a fresh copy of the text.

    The copy matters to pickle, which writes an object it has already written as a back-reference: vLLM's
    lora_name and cache_salt come from different places, so they are distinct objects even when equal, except a
    one-character Latin-1 text, which CPython keeps as a single shared object (the copy preserves that too).
    """
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str or None, not {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{name} must be valid Unicode text (it has a lone surrogate)") from None
    return (value + "\x00")[:-1]


def engine_block_digests(profile: HashProfile, token_ids: Iterable[int], block_size: int,
                         lora_name: str | None = None, cache_salt: str | None = None) -> list[bytes]:
    """The full digest of each full block of a request, as vLLM computes ``request.block_hashes``.

    Same arguments and errors as :func:`engine_block_hashes`; each digest is 32 bytes (16 for the XXH3
    algorithms), and block ``i``'s digest is the parent of block ``i + 1``.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"block_size must be an int, not {type(block_size).__name__}")
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, not {block_size}")
    parent = profile.root_digest  # ValueError for a random seed, before any other work
    tokens = _tokens(token_ids)
    lora = _extra_key_text("lora_name", lora_name)
    salt = _extra_key_text("cache_salt", cache_salt)
    first_keys = tuple(key for key in (lora, salt) if key is not None) or None
    later_keys = (lora,) if lora is not None else None
    digests = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = _hash(profile.algorithm, (parent, tuple(tokens[start:start + block_size]),
                                           first_keys if start == 0 else later_keys))
        digests.append(parent)
    return digests


def engine_block_hashes(profile: HashProfile, token_ids: Iterable[int], block_size: int,
                        lora_name: str | None = None, cache_salt: str | None = None) -> list[bytes]:
    """The block hashes a vLLM engine with this profile publishes for a request, in kvstream's canonical form.

    Args:
        profile: the engine's hash profile; it must be :attr:`HashProfile.recomputable`.
        token_ids: the request's prompt token ids, as Python ints or int-like values (numpy ints), in order.
        block_size: tokens per hashed block, in tokens: the engine's ``--block-size`` (vLLM's
            ``hash_block_size``, which is the cache block size unless several KV cache groups are used).
        lora_name: the request's LoRA adapter name (an extra key on every block); None or "" for none.
        cache_salt: the request's ``cache_salt`` (an extra key on block 0 only); None or "" for none, as vLLM
            ignores an empty salt.

    Returns:
        One 8-byte big-endian hash per full block (``len(token_ids) // block_size`` of them; the trailing
        partial block is not hashed): the digest's low 64 bits, equal to
        ``canonical_block_hash(int published by vLLM)`` (:mod:`schemas.block_hash`).

    Raises:
        ValueError: the profile's seed is random; ``block_size`` below 1; a LoRA name or salt that is not valid
            Unicode (a lone surrogate).
        TypeError: a ``block_size`` that is not an int; ``token_ids`` given as bytes; a token id that is not an
            int (bools too); a LoRA name or salt that is not a str.
    """
    return [digest[-8:] for digest in engine_block_digests(profile, token_ids, block_size, lora_name, cache_salt)]
