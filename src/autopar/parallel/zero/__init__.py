"""Optimizer sharding (ZeRO) on FSDP2."""
