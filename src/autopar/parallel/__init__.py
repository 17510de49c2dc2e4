"""Parallel execution of a network: data parallel (DDP), semi-auto / auto (layouts on DTensor), hybrid.

Kept light at import time: submodules load when a mode needs them.
"""
