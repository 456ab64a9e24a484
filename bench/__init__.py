"""The benchmark harness (``make bench``): every figure of the pipeline measured in one run, on a broker of its own.

Not part of the installed product. Run it from a checkout: ``python -m bench --help``. Figure definitions and
targets: ``bench/README.md``; earlier runs: ``bench/HISTORY.md``.
"""
