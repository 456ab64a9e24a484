"""The fault scenarios (``make chaos``): worker crash, rebalance, broker outage, bridge restart, table recovery.

Not part of the installed product. Run it from a checkout: ``python -m chaos --help``. Each run starts its own
embedded broker and compares the residency table with the simulator's ground truth.
"""
