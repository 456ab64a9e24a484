"""Every topic the pipeline writes has a schema family that the tools (kvstream tail) decode it with."""

from __future__ import annotations

import pytest

from schemas.topics import (KV_EVENTS, KV_EVENTS_DEAD_LETTER, KV_RESIDENCY_CHANGES, KV_TIER_OCCUPANCY, TABLE_FAMILIES,
                            by_ownership_topic, changelog_topic, source_clears_topic, topic_family)


@pytest.mark.parametrize("app_id", ["kvstream", "other-app"])
def test_every_topic_of_an_app_maps_to_its_schema_family(app_id):
    assert topic_family(KV_EVENTS) == "kv_event"
    assert topic_family(KV_RESIDENCY_CHANGES) == "residency_change"
    assert topic_family(KV_TIER_OCCUPANCY) == "tier_occupancy"
    assert topic_family(by_ownership_topic(app_id)) == "ownership_batch"
    assert topic_family(source_clears_topic(app_id)) == "source_clears"
    assert {table: topic_family(changelog_topic(app_id, table)) for table in TABLE_FAMILIES} == {
        "residency": "residency", "clear-watermarks": "clear_watermark", "publisher-epochs": "clear_watermark",
        "tier-occupancy": "tier_occupancy", "sources": "source_status"}


def test_dead_letters_and_unknown_topics_are_raw_bytes():
    assert topic_family(KV_EVENTS_DEAD_LETTER) is None
    assert topic_family("someone-elses-topic") is None
