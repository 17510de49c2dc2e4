"""Parallel execution of a network: one dispatch (``api.attach``) gives it a state (``state``) and its gradient
engines (``grads``); a folder per parallelism -- ``data`` (replicas), ``tensor`` (layouts on DTensor: SEMI_AUTO,
AUTO), ``zero`` (optimizer sharding on FSDP2), ``pipeline`` (torch.distributed.pipelining) -- and ``entry``, the
first-call hooks. Kept light at import time: submodules load when a mode needs them.
"""
