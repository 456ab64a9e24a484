"""What we compute from the events: residency tables, materialized by a Faust app.

* :mod:`stream_apps.residency`: residency semantics as plain functions.
* :mod:`stream_apps.app`: builds one worker's Faust app from its settings (:mod:`stream_apps.settings`) out of
  the repartition process (:mod:`stream_apps.repartition`), the tables and their stores, the materializing
  agent, the output producer, the commit protocol and the HTTP views; its docstring lists their modules.
"""
