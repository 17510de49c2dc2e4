"""The gradient seam (:mod:`autopar.parallel.grads.engine`) and its engines."""
