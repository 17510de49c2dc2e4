"""On a real GPU (skipped without one; ``bench/gpu_check.sh`` runs these where a device is lent): the scripts the
fake-CUDA dry run simulates (tests/scripts/cuda_gpt.py) train on one GPU over NCCL, and the dry run's predicted
peak is set beside ``torch.cuda.max_memory_allocated`` of the real run."""
import json
import re

import pytest
import torch

from procutil import SCRIPTS, autopar_cmd

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")]
CASES = [("dp", "bf16", ()), ("zero3", "bf16", ()), ("auto", "fp16", ()), ("dp", "bf16", ("-", "llama"))]


@pytest.mark.parametrize("mode,precision,extra", CASES)
def test_the_simulated_scripts_train_on_a_gpu_as_the_dry_run_predicts(procs, tmp_path, mode, precision, extra):
    args = [str(SCRIPTS / "cuda_gpt.py"), mode, precision, *extra]
    real = procs.run(autopar_cmd("launch", "-n", "1", "--log-dir", str(tmp_path / "real"), *args), timeout=300)
    assert real.returncode == 0, real.stdout + real.stderr
    measured = [float(m) for m in re.findall(r"step \d: ([\d.]+) MiB on NVIDIA", real.stdout)]
    assert len(measured) == 3, real.stdout
    dry = procs.run(autopar_cmd("launch", "--dry-run", "--dry-run-device", "cuda", "-n", "1", "--log-dir",
                                str(tmp_path / "dry"), *args), timeout=300)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    predicted = json.loads((tmp_path / "dry" / "dryrun.json").read_text())["ranks"]["0"]["steady"]["peak_bytes"]
    ratio = predicted / 2**20 / max(measured)
    print(f"{mode} {precision} {' '.join(extra)}: predicted {predicted / 2**20:.1f} MiB, measured {max(measured):.1f} "
          f"MiB (ratio {ratio:.2f})")
    assert 0.5 <= ratio <= 2.0, (predicted, measured)
