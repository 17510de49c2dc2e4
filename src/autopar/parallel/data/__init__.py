"""Data parallelism: replicas that start equal (the gradient sums are :mod:`autopar.parallel.grads.buckets`)."""
