"""Command line: ``autopar launch | train | data | ckpt | plan``. Thin: parse arguments, call the layers."""
