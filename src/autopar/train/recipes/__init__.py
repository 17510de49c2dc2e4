"""Complete training jobs behind ``autopar train`` (each module runs as a worker script)."""
