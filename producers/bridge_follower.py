"""``kvstream bridge --follow-registrations``: keep a bridge subscribed to every engine registered in
``kv-instances`` (docs/ingesting.md, "Following registrations").

:class:`RegistrationFollower` turns each registration (``POST /register``) and tombstone (``POST /unregister``)
into :meth:`producers.bridge.Bridge.add_endpoint` and :meth:`~producers.bridge.Bridge.remove_endpoint` calls,
and runs the bridge's poll loop between its reads of the feed.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable

from producers.bridge_endpoints import PublisherEndpoint, registration_endpoints

if TYPE_CHECKING:
    # only for annotations: producers.bridge imports this module to re-export RegistrationFollower
    from producers.bridge import Bridge

# every part of the bridge logs as ``producers.bridge``, the name its lines (the text format's name, the JSON's
# ``logger``) had before the bridge was split into modules: log filters and alerts keep matching
log = logging.getLogger("producers.bridge")


class RegistrationFollower:
    """Keeps a :class:`Bridge` subscribed to the engine of every registered instance (``kvstream bridge
    --follow-registrations``, docs/ingesting.md "Following registrations").

    :meth:`apply` is the callback of a :class:`stream_apps.index.registrations.RegistrationsFeed` of
    ``kv-instances``: a registration with an ``endpoint`` subscribes the bridge to its publishers
    (:func:`registration_endpoints`); a tombstone, or a registration without an endpoint, unsubscribes them; a
    changed endpoint, replay endpoint, engine type or set of ranks unsubscribes what is no longer named and
    subscribes what is new (a rank whose publisher is unchanged stays connected). The bridge's own ``--endpoint``
    publishers are never unsubscribed, and a PUB address the bridge already follows is not subscribed again
    (its batches would be produced twice, under two names): it waits until the address is free.

    Args:
        bridge: the bridge to subscribe and unsubscribe; its other endpoints are left alone.
        report_mode: the report mode of every followed engine (:attr:`PublisherEndpoint.report_mode`; None: the
            default), as registrations name none.
        monotonic: the clock of :meth:`run`'s reads of the feed, seconds.
    """

    def __init__(self, bridge: Bridge, report_mode: str | None = None,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.bridge = bridge
        self.report_mode = report_mode
        #: instance id -> the publishers its registration names (what the bridge should follow for it).
        self.wanted: dict[str, list[PublisherEndpoint]] = {}
        #: instance id -> the publishers the bridge follows for it now (a subset of :attr:`wanted`'s).
        self.followed: dict[str, list[PublisherEndpoint]] = {}
        self._monotonic = monotonic
        # publishers not subscribed, with why, so each is logged once, not at every reconciliation
        self._refused: dict[PublisherEndpoint, str] = {}

    def apply(self, instance_id: str, info) -> None:
        """Apply one record of ``kv-instances``: ``info`` (a :class:`stream_apps.index.fleet_index.SourceInfo`) is
        the instance's registration, None its unregistration (a tombstone). Errors of one registration (an
        endpoint the bridge cannot connect to) are logged, never raised: the other instances go on."""
        if info is None:
            wanted, why = [], "unregistered"
        else:
            why = "registration changed" if info.endpoint else "registered without an endpoint"
            try:
                wanted = registration_endpoints(info, self.report_mode)
            except ValueError as exc:
                log.error("registered instance %s: cannot follow its endpoint %s: %s", instance_id, info.endpoint,
                          exc)
                wanted = []
        if wanted:
            self.wanted[instance_id] = wanted
        else:
            self.wanted.pop(instance_id, None)
        for endpoint in [e for e in self._refused if e.instance_id == instance_id and e not in wanted]:
            del self._refused[endpoint]
        self._unsubscribe(instance_id, why)
        self._subscribe(instance_id)
        for other in list(self.wanted):  # a publisher address this instance let go of may be another's to follow
            if other != instance_id:
                self._subscribe(other)

    def _unsubscribe(self, instance_id: str, why: str) -> None:
        wanted = self.wanted.get(instance_id, [])
        kept = []
        for endpoint in self.followed.pop(instance_id, []):
            if endpoint in wanted:
                kept.append(endpoint)
                continue
            self.bridge.remove_endpoint(endpoint)
            log.info("unsubscribed from %s as %s: instance %s %s", endpoint.endpoint, endpoint.label, instance_id,
                     why)
        if kept:
            self.followed[instance_id] = kept

    def _subscribe(self, instance_id: str) -> None:
        followed = self.followed.setdefault(instance_id, [])
        for endpoint in self.wanted.get(instance_id, []):
            if endpoint in followed:
                continue
            holder = next((e for e in self.bridge.endpoints if e.endpoint == endpoint.endpoint), None)
            try:
                if holder is not None:
                    raise ValueError(f"the bridge already follows {endpoint.endpoint} as {holder.label}")
                self.bridge.add_endpoint(endpoint)
            except ValueError as exc:
                if self._refused.get(endpoint) != str(exc):
                    self._refused[endpoint] = str(exc)
                    log.warning("registered instance %s: not subscribed to %s: %s", instance_id, endpoint.endpoint,
                                exc)
                continue
            self._refused.pop(endpoint, None)
            followed.append(endpoint)
            log.info("subscribed to %s (replay: %s) as %s: registered instance %s", endpoint.endpoint,
                     endpoint.replay_endpoint or "none", endpoint.label, instance_id)
        if not followed:
            del self.followed[instance_id]

    def run(self, feed, should_stop: Callable[[], bool] = lambda: False, read_interval_s: float = 0.5) -> None:
        """Poll the bridge until ``should_stop()`` returns True, reading ``feed`` (a ``RegistrationsFeed`` whose
        callback is :meth:`apply`) without waiting every ``read_interval_s`` seconds between the bridge's polls.

        A feed that raises :class:`confluent_kafka.KafkaException` is logged and read again at the next interval:
        the bridge goes on forwarding what it follows while the broker cannot say what changed."""
        from confluent_kafka import KafkaException

        next_read = self._monotonic()
        while not should_stop():
            if self._monotonic() >= next_read:
                try:
                    feed.poll(0)
                except KafkaException as exc:
                    log.warning("reading the registrations in %s: %s; retrying", getattr(feed, "topic", "?"), exc)
                next_read = self._monotonic() + read_interval_s
            self.bridge.poll(100)
