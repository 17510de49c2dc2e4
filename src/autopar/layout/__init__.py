"""The language every parallel piece speaks: where the slices of a tensor live (``Layout``), what a MindSpore
strategy means for an operator (``strategy``), how a device matrix lies on the world mesh (``axes``), DTensor
placements (``placements``) and the strategy file. Pure: nothing here runs a collective, so the runtime
(``autopar.parallel``), the planner (``autopar.planner``) and checkpoints read one definition."""
from autopar.layout.layout import Layout  # noqa: F401
