"""Topic names: shared and per app, with an optional prefix; every topic the pipeline writes has a schema family
that the tools (kvstream tail) decode it with."""

from __future__ import annotations

import pytest

from schemas.topics import TABLE_FAMILIES, TopicNames, topic_family


def test_names_without_and_with_a_prefix():
    plain, prefixed = TopicNames("kvstream"), TopicNames("kvstream", prefix="team-a.")
    assert (plain.kv_events, plain.dead_letter, plain.by_ownership, plain.residency_changes, plain.tier_occupancy,
            plain.source_clears, plain.changelog("residency")) == (
        "kv-events", "kv-events-dead-letter", "kvstream-kv-events-by-ownership", "kvstream-kv-residency-changes",
        "kvstream-kv-tier-occupancy", "kvstream-repartition-source-clears", "kvstream-residency-changelog")
    assert prefixed.scoped_app_id == "team-a.kvstream"
    assert prefixed.kv_events == "team-a.kv-events" and prefixed.dead_letter == "team-a.kv-events-dead-letter"
    assert prefixed.residency_changes == "team-a.kvstream-kv-residency-changes"
    assert prefixed.changelog("sources") == "team-a.kvstream-sources-changelog"


def test_two_apps_share_no_topic_but_kv_events_and_the_dead_letters():
    def names(topics: TopicNames) -> set[str]:
        return {topics.kv_events, topics.dead_letter, topics.by_ownership, topics.residency_changes,
                topics.tier_occupancy, topics.source_clears, *(topics.changelog(t) for t in TABLE_FAMILIES)}

    assert names(TopicNames("gpu-scope")) & names(TopicNames("all-scope")) == {"kv-events", "kv-events-dead-letter"}


@pytest.mark.parametrize("topics", [TopicNames("kvstream"), TopicNames("other-app", prefix="team-a.")])
def test_every_topic_of_an_app_maps_to_its_schema_family(topics):
    assert topic_family(topics.kv_events) == "kv_event"
    assert topic_family(topics.residency_changes) == "residency_change"
    assert topic_family(topics.tier_occupancy) == "tier_occupancy"
    assert topic_family(topics.by_ownership) == "ownership_batch"
    assert topic_family(topics.source_clears) == "source_clears"
    assert {table: topic_family(topics.changelog(table)) for table in TABLE_FAMILIES} == {
        "residency": "residency", "clear-watermarks": "clear_watermark", "publisher-epochs": "clear_watermark",
        "tier-occupancy": "tier_occupancy", "sources": "source_status"}
    assert topic_family(topics.dead_letter) is None


def test_unknown_topics_are_raw_bytes():
    assert topic_family("someone-elses-topic") is None


@pytest.mark.parametrize("topics", [TopicNames("kvstream"), TopicNames("team", prefix="team-a.")])
def test_the_tools_take_each_topic_of_an_app_by_its_short_name(topics):
    """Issue 28: export took kv-residency-changes, tail only kvstream-kv-residency-changes. A short name is the
    app's topic without its '<app id>-' (the prefix goes in front); a full name is taken as it is."""
    from kvstream.export import resolve_source
    from kvstream.settings import app_topic, short_topic_names

    app = topics.scoped_app_id + "-"
    full = {topics.kv_events, topics.dead_letter, topics.by_ownership, topics.residency_changes,
            topics.tier_occupancy, topics.source_clears, topics.schemas, *(topics.changelog(t) for t in TABLE_FAMILIES)}
    shorts = short_topic_names(topics)
    assert set(shorts.values()) == full
    for short, name in shorts.items():
        assert name == topics.prefix + short or name == app + short
        assert app_topic(short, topics) == name and app_topic(name, topics) == name
    assert app_topic("kv-residency-changes", topics) == topics.residency_changes
    assert app_topic("residency-changelog", topics) == topics.changelog("residency")
    assert app_topic("someone-elses-topic", topics) == "someone-elses-topic"
    for name in ("kv-residency-changes", topics.residency_changes):
        assert resolve_source(name, topics).topic == topics.residency_changes
    for name in ("residency", "residency-changelog", topics.changelog("residency")):
        assert (resolve_source(name, topics).kind, resolve_source(name, topics).topic) == (
            "residency", topics.changelog("residency"))
    with pytest.raises(ValueError, match="cannot export 'sources-changelog'"):
        resolve_source("sources-changelog", topics)
