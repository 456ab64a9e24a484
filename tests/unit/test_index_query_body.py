"""The JSON ``POST /query`` body reader: the compiled one-pass reader of ``token_ids``
(``schemas._hotpath.json_query_token_ids``, ``json_token_bytes``) against its Python twin, on every body."""

from __future__ import annotations

import array
import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.compiled import HOTPATH
from schemas.content_hash import block_content_digests, block_content_hashes
from stream_apps.index.api import BadRequest, read_json_query, token_ids_bytes

pytestmark = pytest.mark.skipif(HOTPATH is None, reason="schemas/_hotpath.pyx is not built")


def _outcome(body: bytes, compiled: bool):
    """What reading ``body`` gives: the fields and token ids, or the error's type and message."""
    try:
        request, tokens = read_json_query(body, compiled=compiled)
    except (BadRequest, msgspec.MsgspecError) as exc:
        return type(exc).__name__, str(exc)
    fields = {f: getattr(request, f) for f in request.__struct_fields__ if f != "token_ids"}
    return fields, array.array("I", tokens).tolist()


def test_a_body_is_read_in_one_pass_with_its_token_ids_as_u32():
    body = b'{"model": "m", "token_ids": [1, 2, -1, 4294967295, -2147483648], "block_size": 2}'
    found = HOTPATH.json_query_token_ids(body)
    assert found is not None and body[found[1]:found[2]] == b"[1, 2, -1, 4294967295, -2147483648]"
    assert array.array("I", found[0]).tolist() == [1, 2, 4294967295, 4294967295, 2147483648]
    assert _outcome(body, True) == _outcome(body, False)
    assert _outcome(body, True)[0]["model"] == "m"


@pytest.mark.parametrize("body", [
    b'{"token_ids": [1.0]}', b'{"token_ids": [01]}', b'{"token_ids": [1,]}', b'{"token_ids": [4294967296]}',
    b'{"token_ids": [-2147483649]}', b'{"token_ids": ["1"]}', b'{"token_ids": [1 2]}', b'{"token_ids": 5}',
    b'{"token_ids": [1], "token_ids": [2]}', b'{"tok\\u0065n_ids": [1]}', b'{}', b'{"token_ids": [1]} x',
    b'[1]', b'', b'{"token_ids": [1], "model": nope}', b'{"token_ids": [1], "block_size": 0}',
    b'{"model": "a\\"b", "x": {"y": [1, {"z": "]}"}]}, "token_ids": [5]}', b'{"token_ids": [99999999999]}',
    b'{"token_ids": [1e3]}', b'{"token_ids": [-]}', b'{"token_ids": [1]', b'{"a": "\\', b'{"token_ids":[]}',
])
def test_the_compiled_reader_takes_or_leaves_a_body_as_the_python_twin_reads_it(body):
    assert _outcome(body, True) == _outcome(body, False)


def test_an_error_names_the_token_by_its_place_in_the_body():
    with pytest.raises(BadRequest, match=r"got `float` - at `\$\.token_ids\[1\]`"):
        read_json_query(b'{"token_ids": [1, 2.5]}', compiled=True)
    with pytest.raises(BadRequest, match=r"Expected `array`, got `str` - at `\$\.token_ids`"):
        token_ids_bytes(b'"abc"', compiled=False)


_TOKEN = st.one_of(st.integers(-(1 << 31), (1 << 32) - 1), st.integers(-(1 << 40), 1 << 40),
                   st.sampled_from([0, -0.0, 1.5, 1e3, "7", None, True]))
_SPACE = st.sampled_from(["", " ", "\n", "\t ", "\r\n"])
_VALUE = st.one_of(st.none(), st.booleans(), st.integers(-5, 600), st.text(max_size=8),
                   st.lists(st.integers(0, 3), max_size=3), st.dictionaries(st.text(max_size=3), st.text(max_size=3),
                                                                           max_size=2))


@st.composite
def _bodies(draw) -> bytes:
    """JSON bodies with the fields of /query and others in any order and spacing, some of them wrong."""
    fields = draw(st.dictionaries(st.sampled_from(["model", "block_size", "lora_name", "cache_salt", "other", "ü"]),
                                  _VALUE, max_size=4))
    items = [json.dumps(k) + draw(_SPACE) + ":" + draw(_SPACE) + json.dumps(v) for k, v in fields.items()]
    if draw(st.booleans()):
        tokens = draw(st.lists(_TOKEN, max_size=12))
        array_text = "[" + ",".join(draw(_SPACE) + json.dumps(t) + draw(_SPACE) for t in tokens) + "]"
        items.insert(draw(st.integers(0, len(items))), '"token_ids"' + draw(_SPACE) + ":" + array_text)
    body = "{" + draw(_SPACE) + ("," + draw(_SPACE)).join(items) + draw(_SPACE) + "}"
    if draw(st.integers(0, 9)) == 0:  # now and then a truncated or extended body
        body = body[:draw(st.integers(0, len(body)))] + draw(st.sampled_from(["", "x", "}", ","]))
    return body.encode()


@settings(max_examples=500, deadline=None)
@given(_bodies())
def test_compiled_and_python_readers_agree_on_any_body(body):
    assert _outcome(body, True) == _outcome(body, False)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(-(1 << 31), (1 << 32) - 1), max_size=40), st.integers(1, 8),
       st.sampled_from([None, "adapter-1"]), st.sampled_from([None, "salt"]))
def test_content_digests_are_the_content_hashes_unsigned(tokens, block_size, lora, salt):
    signed = block_content_hashes(tokens, block_size, lora, salt)
    assert [h & ((1 << 64) - 1) for h in signed] == block_content_digests(tokens, block_size, lora, salt)
    assert len(signed) == len(tokens) // block_size
