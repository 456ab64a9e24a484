"""vLLM's block hashes recomputed from token ids and a registered hash profile (schemas.engine_hashes).

Three kinds of evidence:

* hand-built serializations: ``_pickle5`` and ``_cbor`` below encode the (parent, tokens, extra keys) values
  opcode by opcode from the pickle protocol-5 and CBOR (RFC 8949) specifications, without pickle or cbor2, and
  the digests of those bytes must equal what the module computes with the real serializers. The sha256_cbor and
  xxhash cases are derived this way, by hand from vLLM's recipe (``vllm/utils/hashing.py``,
  ``vllm/v1/core/kv_cache_utils.py``);
* Mooncake's golden vectors (kvcache-ai/Mooncake, Apache-2.0, ``mooncake-conductor/tests/fixtures/
  hash_golden_vectors_sha256.json`` for sha256 and ``hash_golden_vectors.json`` for sha256_cbor): every case
  must pass. The files are not in this repository: the test reads them from the folder named by
  ``KVSTREAM_HASH_GOLDEN_VECTORS`` and skips, naming the variable, when it is not set (tests/README.md);
* behaviour: LoRA, salt, seed text and UTF-8 change the hashes; the errors.
"""

from __future__ import annotations

import array
import hashlib
import json
import os
import pickle
import unicodedata
from pathlib import Path

import pytest
import xxhash

from schemas.block_hash import canonical_block_hash
from schemas.engine_hashes import (
    ALGORITHMS,
    MAX_PYTHON_HASH_SEED,
    VLLM_DEFAULT_SEED,
    HashProfile,
    engine_block_digests,
    engine_block_hashes,
    none_hash,
)

_U64 = (1 << 64) - 1


# --- hand-built serializations -----------------------------------------------------------------------------------

def _pickle5(value) -> bytes:
    """Pickle protocol 5 of a value made of None, int32, bytes (< 256), str and tuples, in one frame (< 64 KiB).

    Opcodes: PROTO 5; FRAME with the body's 8-byte little-endian length; NONE ``N``; BININT1 ``K`` (0..255),
    BININT2 ``M`` (256..65535), BININT ``J`` (other int32); SHORT_BINBYTES ``C``; SHORT_BINUNICODE 0x8c (under
    256 UTF-8 bytes) or BINUNICODE ``X``; EMPTY_TUPLE ``)``, TUPLE1..3 (0x85..0x87) after the items, or MARK ``(``
    items TUPLE ``t``; MEMOIZE 0x94 after every bytes, str and non-empty tuple; STOP ``.``.
    """
    body = bytearray()

    def save(item) -> None:
        if item is None:
            body.extend(b"N")
        elif type(item) is int:
            if 0 <= item <= 0xFF:
                body.extend(b"K" + item.to_bytes(1, "little"))
            elif 0 <= item <= 0xFFFF:
                body.extend(b"M" + item.to_bytes(2, "little"))
            else:
                body.extend(b"J" + item.to_bytes(4, "little", signed=True))
        elif type(item) is bytes:
            assert len(item) < 256
            body.extend(b"C" + bytes([len(item)]) + item + b"\x94")
        elif type(item) is str:
            data = item.encode("utf-8")
            head = b"\x8c" + bytes([len(data)]) if len(data) < 256 else b"X" + len(data).to_bytes(4, "little")
            body.extend(head + data + b"\x94")
        elif type(item) is tuple:
            if not item:
                body.extend(b")")
                return
            if len(item) > 3:
                body.extend(b"(")
            for element in item:
                save(element)
            body.extend({1: b"\x85", 2: b"\x86", 3: b"\x87"}.get(len(item), b"t") + b"\x94")
        else:
            raise AssertionError(f"no hand encoding for {type(item).__name__}")

    save(value)
    body.extend(b".")
    assert len(body) < 64 * 1024
    return b"\x80\x05\x95" + len(body).to_bytes(8, "little") + bytes(body)


def _cbor_head(major: int, number: int) -> bytes:
    if number < 24:
        return bytes([major << 5 | number])
    for info, width in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if number < 1 << (8 * width):
            return bytes([major << 5 | info]) + number.to_bytes(width, "big")
    raise AssertionError(number)


def _cbor(value) -> bytes:
    """Canonical CBOR of None (0xf6), ints (major 0 / 1), bytes (2), str (3) and tuples as arrays (4)."""
    if value is None:
        return b"\xf6"
    if type(value) is int:
        return _cbor_head(0, value) if value >= 0 else _cbor_head(1, -1 - value)
    if type(value) is bytes:
        return _cbor_head(2, len(value)) + value
    if type(value) is str:
        data = value.encode("utf-8")
        return _cbor_head(3, len(data)) + data
    if type(value) is tuple:
        return _cbor_head(4, len(value)) + b"".join(_cbor(item) for item in value)
    raise AssertionError(f"no hand encoding for {type(value).__name__}")


_HAND = {
    "sha256": lambda value: hashlib.sha256(_pickle5(value)).digest(),
    "sha256_cbor": lambda value: hashlib.sha256(_cbor(value)).digest(),
    "xxhash": lambda value: xxhash.xxh3_128(_pickle5(value)).digest(),
    "xxhash_cbor": lambda value: xxhash.xxh3_128(_cbor(value)).digest(),
}


def _hand_chain(algorithm, seed, tokens, block_size, lora=None, salt=None) -> list[bytes]:
    """The recipe written out: root = H(seed); block i = H((parent, tuple(tokens), keys)); keys per vLLM."""
    hash_fn = _HAND[algorithm]
    parent, digests = hash_fn(seed), []
    for index in range(len(tokens) // block_size):
        keys = ([lora] if lora else []) + ([salt] if salt and index == 0 else [])
        parent = hash_fn((parent, tuple(tokens[index * block_size:(index + 1) * block_size]), tuple(keys) or None))
        digests.append(parent)
    return digests


def _profile(algorithm="sha256", seed="0") -> HashProfile:
    return HashProfile.parse({"strategy": "vllm_v1", "algorithm": algorithm, "python_hash_seed": seed,
                              "index_projection": "low64_be"})


#: name -> (token ids, block size, lora_name, cache_salt)
_HAND_CASES = {
    "two_blocks": (list(range(1, 9)), 4, None, None),
    "one_token_blocks": ([7, 8, 9], 1, None, None),
    "three_token_block_and_tail": ([7, 8, 9, 10, 11], 3, None, None),
    "int_opcode_boundaries": ([-2**31, -1, 0, 23, 24, 255, 256, 65535, 65536, 2**31 - 1], 10, None, None),
    "array_length_24": (list(range(100, 124)), 24, None, None),
    "lora": (list(range(1, 13)), 4, "adapter-7", None),
    "salt": (list(range(1, 13)), 4, None, "tenant-42"),
    "lora_then_salt": (list(range(1, 13)), 4, "adapter-7", "tenant-42"),
    "utf8": ([5, 6, 7, 8], 4, "réglage-日本語", "sel-🧂-ß"),
    "text_length_23_24": ([1, 2], 1, "x" * 23, "y" * 24),
    "text_length_255_256": ([1, 2], 1, "x" * 255, "y" * 256),
    "no_full_block": ([1, 2, 3], 4, "adapter-7", None),
}


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("seed", ["0", "00", "1234", str(MAX_PYTHON_HASH_SEED)])
def test_the_root_is_the_hash_of_the_seed_text(algorithm, seed):
    profile = _profile(algorithm, seed)
    assert profile.root_digest == none_hash(algorithm, seed) == _HAND[algorithm](seed)
    assert len(profile.root_digest) == (32 if algorithm.startswith("sha256") else 16)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("case", sorted(_HAND_CASES))
def test_digests_equal_the_hand_serialized_recipe(algorithm, case):
    tokens, block_size, lora, salt = _HAND_CASES[case]
    expected = _hand_chain(algorithm, "0", tokens, block_size, lora, salt)
    profile = _profile(algorithm)
    assert engine_block_digests(profile, tokens, block_size, lora, salt) == expected
    assert len(expected) == len(tokens) // block_size
    assert engine_block_hashes(profile, tokens, block_size, lora, salt) == [digest[-8:] for digest in expected]


def test_pinned_roots_and_first_block():
    # Computed here with the hand serializations above: seed "0", tokens 1..4, no extra keys.
    assert _pickle5("0") == bytes.fromhex("80059505000000000000008c0130942e")
    assert _cbor("0") == b"\x61\x30"
    assert _profile("sha256").root_digest.hex() == "1973e23848344dc43a988a9b478663803cfffe1243480253f9a3cf004b14aa7c"
    assert _profile("sha256_cbor").root_digest.hex() == (
        "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e")
    assert engine_block_hashes(_profile("sha256"), [1, 2, 3, 4], 4) == [bytes.fromhex("8fce057e23bae91d")]
    assert engine_block_hashes(_profile("sha256_cbor"), [1, 2, 3, 4], 4) == [bytes.fromhex("1e0b2e028ef071cb")]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_hashes_are_the_canonical_form_of_vllms_int_hashes(algorithm):
    profile, tokens = _profile(algorithm), list(range(40))
    digests = engine_block_digests(profile, tokens, 8)
    published = [int.from_bytes(digest, "big") & _U64 for digest in digests]  # maybe_convert_block_hash
    assert engine_block_hashes(profile, tokens, 8) == [canonical_block_hash(value) for value in published]
    assert all(len(key) == 8 for key in engine_block_hashes(profile, tokens, 8))


def test_xxhash_projection_is_the_low_64_bits_of_xxh3_128():
    profile, tokens = _profile("xxhash_cbor"), [3, 1, 4, 1, 5, 9, 2, 6]
    root = profile.root_digest
    block0 = xxhash.xxh3_128_intdigest(_cbor((root, (3, 1, 4, 1), None)))
    assert engine_block_hashes(profile, tokens, 4)[0] == (block0 & _U64).to_bytes(8, "big")


# --- Mooncake's golden vectors ------------------------------------------------------------------------------------

_GOLDEN_FILES = ("hash_golden_vectors_sha256.json", "hash_golden_vectors.json")


def _golden_file(name: str) -> Path | None:
    folder = os.environ.get("KVSTREAM_HASH_GOLDEN_VECTORS")
    path = Path(folder) / name if folder else None
    return path if path is not None and path.is_file() else None


def _golden(name: str) -> dict:
    path = _golden_file(name)
    if path is None:
        pytest.skip(f"{name} (kvcache-ai/Mooncake, mooncake-conductor/tests/fixtures/) not found: set "
                    "KVSTREAM_HASH_GOLDEN_VECTORS to its folder")
    return json.loads(path.read_text(encoding="utf-8"))


def _repeat(case: dict, key: str, default):
    spec = case.get(f"{key}_repeat")
    return [spec["value"]] * spec["count"] if spec and key == "token_ids" else (
        spec["value"] * spec["count"] if spec else default)


@pytest.mark.parametrize("name", _GOLDEN_FILES)
def test_every_mooncake_golden_vector(name):
    vectors = _golden(name)
    profile = HashProfile.parse(vectors["profile"])  # root_digest included: it must match the seed
    for root in vectors["seed_root_vectors"]:
        # The golden files also pin the literal text "random" as a seed; none_hash hashes any text.
        assert none_hash(profile.algorithm, root["python_hash_seed"]).hex() == root["root_digest"], root
    assert len(vectors["cases"]) >= 10
    for case in vectors["cases"]:
        tokens = _repeat(case, "token_ids", case.get("token_ids"))
        lora = _repeat(case, "lora_name", case["lora_name"])
        digests = engine_block_digests(profile, tokens, case["block_size"], lora, case["cache_salt"])
        assert [digest.hex() for digest in digests] == [block["digest"] for block in case["expected"]], case["name"]
        keys = engine_block_hashes(profile, tokens, case["block_size"], lora, case["cache_salt"])
        assert [key.hex() for key in keys] == [block["projected_hex"] for block in case["expected"]]
        assert keys == [canonical_block_hash(int(block["projected_decimal"])) for block in case["expected"]]
        if "incorrect_low64_parent_digest" in case:  # chaining on the 8-byte projection is the classic mistake
            assert digests[1].hex() != case["incorrect_low64_parent_digest"]


# --- behaviour ----------------------------------------------------------------------------------------------------

_TOKENS = list(range(1000, 1016))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_lora_changes_every_block_and_salt_only_seeds_block_zero(algorithm):
    profile = _profile(algorithm)
    plain = engine_block_digests(profile, _TOKENS, 4)
    lora = engine_block_digests(profile, _TOKENS, 4, lora_name="adapter-A")
    other_lora = engine_block_digests(profile, _TOKENS, 4, lora_name="adapter-B")
    salted = engine_block_digests(profile, _TOKENS, 4, cache_salt="tenant")
    assert len({*plain, *lora, *other_lora, *salted}) == 16  # all four chains differ at every block
    # The salt is an extra key of block 0 only: block 1 hashes (salted parent, tokens, None).
    assert salted[1] == _HAND[algorithm]((salted[0], tuple(_TOKENS[4:8]), None))
    assert lora[1] == _HAND[algorithm]((lora[0], tuple(_TOKENS[4:8]), ("adapter-A",)))


def test_empty_lora_or_salt_is_none():
    profile = _profile()
    assert engine_block_hashes(profile, _TOKENS, 4, "", "") == engine_block_hashes(profile, _TOKENS, 4)


def test_utf8_text_is_hashed_as_given():
    profile = _profile("sha256_cbor")
    composed, decomposed = unicodedata.normalize("NFC", "modèle"), unicodedata.normalize("NFD", "modèle")
    assert composed != decomposed
    hashes = {engine_block_hashes(profile, _TOKENS, 4, lora_name=name)[0] for name in (composed, decomposed)}
    assert len(hashes) == 2
    assert engine_block_hashes(profile, _TOKENS, 4, cache_salt="🧂")[0] != engine_block_hashes(
        profile, _TOKENS, 4, cache_salt="🧂 ")[0]


def test_seed_text_algorithm_and_block_size_each_change_the_hashes():
    results = {tuple(engine_block_hashes(_profile(algorithm, seed), _TOKENS, 4))
               for algorithm in ALGORITHMS for seed in ("0", "00", "1")}
    assert len(results) == len(ALGORITHMS) * 3
    assert engine_block_hashes(_profile(), _TOKENS, 8)[0] != engine_block_hashes(_profile(), _TOKENS, 4)[1]


def test_only_full_blocks_are_hashed_and_prefixes_share_hashes():
    profile = _profile()
    assert engine_block_hashes(profile, [], 4) == []
    assert engine_block_hashes(profile, _TOKENS[:3], 4) == []
    full = engine_block_hashes(profile, _TOKENS, 4)
    assert engine_block_hashes(profile, _TOKENS[:11], 4) == full[:2]
    assert engine_block_hashes(profile, _TOKENS + [7, 7], 4) == full


def test_token_ids_may_be_any_iterable_of_int_like_values():
    class Token:
        def __init__(self, value):
            self.value = value

        def __index__(self):
            return self.value

    profile = _profile()
    expected = engine_block_hashes(profile, _TOKENS, 4)
    assert engine_block_hashes(profile, tuple(_TOKENS), 4) == expected
    assert engine_block_hashes(profile, array.array("i", _TOKENS), 4) == expected
    assert engine_block_hashes(profile, iter(_TOKENS), 4) == expected
    assert engine_block_hashes(profile, [Token(t) for t in _TOKENS], 4) == expected


def test_equal_lora_and_salt_are_pickled_as_vllm_would():
    profile, tokens = _profile("sha256"), [1, 2, 3, 4]
    root = profile.root_digest
    # Equal texts from different places are different objects in vLLM, so both are written out in full, even
    # when the caller passes one object twice...
    same = "shared-name"
    assert engine_block_digests(profile, tokens, 4, same, same) == [
        hashlib.sha256(_pickle5((root, (1, 2, 3, 4), (same, same)))).digest()]
    # ...but CPython keeps every one-character Latin-1 text as one object, so vLLM's pickle writes the salt as a
    # back-reference (BINGET) to the LoRA name.
    vllm_bytes = pickle.dumps((root, (1, 2, 3, 4), ("a", "a")), protocol=5)
    assert b"h" in vllm_bytes[-8:] and vllm_bytes != _pickle5((root, (1, 2, 3, 4), ("a", "a")))
    assert engine_block_digests(profile, tokens, 4, "a", "a") == [hashlib.sha256(vllm_bytes).digest()]


def test_vllm_default_seed_for_an_unset_pythonhashseed():
    profile = HashProfile("sha256_cbor", VLLM_DEFAULT_SEED)
    assert profile.recomputable and profile.root_digest == _HAND["sha256_cbor"]("vllm-none-hash")
    assert HashProfile.parse(profile.as_dict()) == profile


# --- profiles and errors ------------------------------------------------------------------------------------------

def test_parse_and_round_trip():
    raw = {"strategy": "vllm_v1", "algorithm": "sha256_cbor", "python_hash_seed": "007",
           "index_projection": "low64_be"}
    profile = HashProfile.parse(raw)
    assert profile == HashProfile("sha256_cbor", "007", "low64_be") and profile.recomputable
    assert profile.as_dict() == raw and HashProfile.parse(profile.as_dict()) == profile
    with_root = dict(raw, root_digest=profile.root_digest.hex())
    assert HashProfile.parse(with_root) == profile


def test_a_random_seed_is_not_recomputable():
    profile = _profile("sha256", "random")
    assert profile.python_hash_seed is None and not profile.recomputable
    assert profile.as_dict()["python_hash_seed"] == "random"
    with pytest.raises(ValueError, match="random"):
        engine_block_hashes(profile, _TOKENS, 4)
    with pytest.raises(ValueError, match="cannot be recomputed"):
        engine_block_digests(profile, _TOKENS, 4)
    with pytest.raises(ValueError, match="random"):
        profile.root_digest  # noqa: B018
    # A root_digest given with a random seed is not checked (Mooncake shows the hash of the text "random").
    assert not HashProfile.parse(dict(profile.as_dict(), root_digest="ab" * 32)).recomputable


_GOOD = {"strategy": "vllm_v1", "algorithm": "sha256", "python_hash_seed": "0", "index_projection": "low64_be"}


@pytest.mark.parametrize(("change", "message"), [
    ({"strategy": "vllm_v0"}, "unsupported hash strategy 'vllm_v0'"),
    ({"algorithm": "md5"}, "unsupported hash algorithm 'md5'.*sha256, sha256_cbor, xxhash, xxhash_cbor"),
    ({"algorithm": "sha256_msgpack"}, "unsupported hash algorithm"),
    ({"index_projection": "low64_le"}, "unsupported index projection 'low64_le'.*low64_be"),
    ({"index_projection": "high64_be"}, "unsupported index projection"),
    ({"python_hash_seed": ""}, "not a PYTHONHASHSEED value"),
    ({"python_hash_seed": "-1"}, "not a PYTHONHASHSEED value"),
    ({"python_hash_seed": "+1"}, "not a PYTHONHASHSEED value"),
    ({"python_hash_seed": " 0"}, "not a PYTHONHASHSEED value"),
    ({"python_hash_seed": "0\n"}, "not a PYTHONHASHSEED value"),
    ({"python_hash_seed": "1.0"}, "not a PYTHONHASHSEED value"),
    ({"python_hash_seed": "Random"}, "not a PYTHONHASHSEED value"),
    ({"python_hash_seed": "٣"}, "not a PYTHONHASHSEED value"),  # a digit, but not ASCII
    ({"python_hash_seed": "4294967296"}, "above 4294967295"),
    ({"python_hash_seed": 0}, "must be a string"),
    ({"python_hash_seed": None}, "must be a string"),
    ({"algorithm": "xxhash", "python_hash_seed": VLLM_DEFAULT_SEED}, "sha256 and sha256_cbor only"),
    ({"root_digest": "00" * 32}, "is not the sha256 root"),
    ({"root_digest": "zz" * 32}, "must be 64 hex digits"),
    ({"algorithm": "xxhash", "root_digest": "00" * 32}, "must be 32 hex digits for xxhash"),
    ({"python_hashseed": "0"}, "unknown keys python_hashseed"),
])
def test_parse_rejects_with_a_clear_message(change, message):
    raw = dict(_GOOD, **change)
    with pytest.raises(ValueError, match=message):
        HashProfile.parse(raw)


def test_parse_rejects_missing_keys_and_non_mappings():
    with pytest.raises(ValueError, match="lacks python_hash_seed, index_projection"):
        HashProfile.parse({"strategy": "vllm_v1", "algorithm": "sha256"})
    with pytest.raises(TypeError, match="must be a mapping"):
        HashProfile.parse([("strategy", "vllm_v1")])  # type: ignore[arg-type]


def test_the_constructor_checks_too():
    with pytest.raises(ValueError, match="unsupported hash algorithm"):
        HashProfile("blake3", "0")
    with pytest.raises(ValueError, match="construct HashProfile with None"):
        HashProfile("sha256", "random")
    with pytest.raises(ValueError, match="unsupported index projection"):
        HashProfile("sha256", "0", "low32_be")
    assert not HashProfile("xxhash", None).recomputable


def test_bad_arguments():
    profile = _profile()
    with pytest.raises(ValueError, match="block_size must be at least 1"):
        engine_block_hashes(profile, _TOKENS, 0)
    with pytest.raises(TypeError, match="block_size must be an int"):
        engine_block_hashes(profile, _TOKENS, 4.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="block_size must be an int"):
        engine_block_hashes(profile, _TOKENS, True)
    with pytest.raises(TypeError, match="is a bool"):
        engine_block_hashes(profile, [1, True, 3, 4], 4)
    with pytest.raises(TypeError, match="is a float"):
        engine_block_hashes(profile, [1, 2.0, 3, 4], 4)
    with pytest.raises(TypeError, match="is a str"):
        engine_block_hashes(profile, "1234", 4)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="decode it first"):
        engine_block_hashes(profile, array.array("i", _TOKENS).tobytes(), 4)
    with pytest.raises(TypeError, match="lora_name must be a str"):
        engine_block_hashes(profile, _TOKENS, 4, lora_name=7)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cache_salt must be valid Unicode"):
        engine_block_hashes(profile, _TOKENS, 4, cache_salt="bad\ud800")
    with pytest.raises(ValueError, match="unsupported hash algorithm"):
        none_hash("sha1", "0")
    with pytest.raises(TypeError, match="seed must be a str"):
        none_hash("sha256", 0)  # type: ignore[arg-type]
