"""What we compute from the events: residency tables, materialized by a Faust app.

* :mod:`stream_apps.residency`: residency semantics as plain functions.
* :mod:`stream_apps.app`: the Faust app (agents, tables, HTTP views).
"""
