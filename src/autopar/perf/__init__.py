"""Speed levers: each measured on its own (``bench/levers.py``) before becoming a default, each switchable through
the environment, none changing results beyond float tolerance (:mod:`autopar.perf.tuning`)."""
