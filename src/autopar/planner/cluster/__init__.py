"""The cluster model: plans for clusters you do not have, one file per cost concern, each checkable against its
sources alone.

- ``spec.py``: a cluster as data (device, nodes, links); ``files.py``: cluster files and presets, with one-line errors;
- ``kernels.py``: compute -- what a GEMM of a given shape reaches on the device's SMs, the rates of fused attention,
  fp8 projections and memory-bound work;
- ``attention.py``: the materialized attention core, context parallelism's key/value ring;
- ``collectives.py``: collectives on the topology as NCCL runs them, the data-parallel sync and ZeRO's;
- ``pipeline.py``: 1F1B and interleaved schedules, their bubble and micro-batches in flight;
- ``memory.py``: optimizer state per ZeRO level, the activations a layer and a stage keep;
- ``layers.py``: one decoder layer and the head planned on a tensor group by the operator-level ILP;
- ``search.py``: the mesh search, its plan and its explanation.
"""
from autopar.planner.cluster.files import dry_run_machine, load_cluster, parse_cluster, presets
from autopar.planner.cluster.search import Candidate, MeshPlan, plan_gpt
from autopar.planner.cluster.spec import ClusterSpec, Link

__all__ = ["Candidate", "ClusterSpec", "Link", "MeshPlan", "dry_run_machine", "load_cluster", "parse_cluster",
           "plan_gpt", "presets"]
