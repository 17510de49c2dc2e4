"""The sweep's cases, by category (each module registers its own with ``sweep.case``)."""
from sweep_cases import checkpoints, cli_inputs, context_values, ending, environment, faults  # noqa: F401
