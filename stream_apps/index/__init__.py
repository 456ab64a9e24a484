"""The fleet index for KV-aware routers: every resident (block, holder) of the serving fleet, held in memory and
fed by the residency table's entries, so that a router can ask which holders hold the longest prefix of a
request's block chain (by engine block hash, or by content along the token path). :mod:`stream_apps.index.table`
is its compact integer-keyed block table (compiled in ``_table.pyx``, with a pure-Python twin); the layers above
it intern the fleet's strings into the table's integer ids.
"""
