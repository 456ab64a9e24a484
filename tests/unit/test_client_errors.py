"""kvstream.client against a URL where nothing answers: one error of the client's own, naming the URL."""

from __future__ import annotations

import asyncio

import pytest

from kvstream.broker import free_port
from kvstream.client import AsyncIndexClient, IndexClient, IndexUnreachableError


def test_the_sync_client_names_the_url_nothing_answered_at():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(IndexUnreachableError) as caught:
        IndexClient(url).query([1, 2, 3])
    assert caught.value.url == url and url in str(caught.value)
    assert isinstance(caught.value.__cause__, ConnectionRefusedError)
    assert isinstance(caught.value, OSError)  # code that caught OSError before still does


def test_the_async_client_names_the_url_nothing_answered_at():
    url = f"http://127.0.0.1:{free_port()}"

    async def ask():
        client = AsyncIndexClient(url)
        try:
            await client.query([1, 2, 3])
        finally:
            await client.close()

    with pytest.raises(IndexUnreachableError) as caught:
        asyncio.run(ask())
    assert caught.value.url == url and url in str(caught.value)
