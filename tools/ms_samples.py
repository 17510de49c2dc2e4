"""Where MindSpore's distributed samples are: the docs repository's sample folders and parallel tutorial pages of
branches r1.5 .. master (``extract``), and the 15 samples of issue 29 (``CORE``). Shared by ``ms_names.py`` and
``run_ms_samples.py``. The files are public code: they are written to a scratch directory, never committed."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

BRANCHES = re.compile(r"^(r1\.([5-9]|1[01])|r2\.[0-6](\.0)?|master)$")
SAMPLE_FOLDERS = re.compile(r"^(distributed_\w+|manual_parallel|recompute|sharding_propagation|startup_method|"
                            r"parallel_support_dynamic_shape|high_dimension_tensor_parallel|shard_function_parallel|"
                            r"pynative_shard_function_parallel|operator_parallel|gradient_accumulation|comm_subgraph|"
                            r"dataset_slice|disaster_recover)$")
TUTORIAL_DIRS = ("tutorials/experts/source_en/parallel", "tutorials/source_en/parallel",
                 "docs/mindspore/source_en/features/parallel")

# The 15 distributed samples of issue 29 (paths in the --extract layout): label -> files.
CORE = {
    "CPU ResNet-50 tutorial (with its resnet.py)": ["r2.1/distributed_training_cpu/resnet50_distributed_training.py",
                                                    "r2.1/distributed_training_cpu/resnet.py"],
    "data parallel": ["r2.3/distributed_data_parallel/distributed_data_parallel.py"],
    "dynamic-cluster startup": ["r2.3/startup_method/net.py"],
    "operator parallel": ["r2.3/distributed_operator_parallel/distributed_operator_parallel.py"],
    "optimizer parallel": ["r2.3/distributed_optimizer_parallel/distributed_optimizer_parallel.py"],
    "pipeline parallel r2.2": ["r2.2/distributed_pipeline_parallel/distributed_pipeline_parallel.py"],
    "pipeline parallel r2.3": ["r2.3/distributed_pipeline_parallel/distributed_pipeline_parallel.py"],
    "gradient accumulation": ["r2.3/distributed_gradient_accumulation/train.py"],
    "sharding propagation": ["r2.3/sharding_propagation/train.py"],
    "manual parallel": ["r2.3/manual_parallel/train.py"],
    "recompute": ["r2.3/recompute/train.py"],
    "parallel quick start": ["r2.1/distributed_training_quickstart/net.py"],
    "r1.x operator parallel (rank table)": ["r1.10/operator_parallel/train.py"],
    "2.6 operator parallel (AutoParallel)": ["r2.6.0/distributed_operator_parallel/distributed_operator_parallel.py"],
    "distributed inference": [f"r2.1/distributed_inference/{f}.py" for f in
                              ("distributed_training", "distributed_inference", "net", "dataset")],
}


def extract(git_dir: Path, out: Path) -> int:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(git_dir), *args], check=True, capture_output=True).stdout.decode()

    count = 0
    branches = [b for b in git("branch", "--format=%(refname:short)").split() if BRANCHES.match(b)]
    for branch in branches:
        files = git("ls-tree", "-r", "--name-only", branch, "docs/sample_code", *TUTORIAL_DIRS).splitlines()
        for path in files:
            parts = path.split("/")
            if path.startswith("docs/sample_code/") and path.endswith(".py") and SAMPLE_FOLDERS.match(parts[2]):
                dest = out / "sample_code" / branch / "/".join(parts[2:])
            elif path.endswith(".md") and not path.startswith("docs/sample_code/"):
                dest = out / "tutorials" / branch / path
            else:
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(subprocess.run(["git", "-C", str(git_dir), "show", f"{branch}:{path}"], check=True,
                                            capture_output=True).stdout)
            count += 1
    return count
