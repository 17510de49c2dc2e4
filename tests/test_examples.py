"""The examples run as documented: the all-gather sample and the CPU tutorial's run.sh (manual dynamic cluster)."""
import re

from autopar.cluster.netutil import free_port
from autopar.dataset.synth import write_synthetic_cifar10
from procutil import PYTHON, ROOT, autopar_cmd


def test_allgather_example_prints_the_tutorial_output(procs, tmp_path):
    res = procs.run(autopar_cmd("launch", "-n", "4", "--log-dir", str(tmp_path), str(ROOT / "examples/allgather.py")),
                    timeout=180)
    assert res.returncode == 0, res.stderr
    assert "[[0.], [1.], [2.], [3.]]" in res.stdout


def test_tutorial_run_sh_trains(procs, tmp_path):
    data = write_synthetic_cifar10(tmp_path / "data", records_per_file=64)  # 384 images: 6 steps of 32 per rank
    env = procs.env(WORKER_NUM="2", SCHED_PORT=str(free_port()), IMAGE_SIZE="32", EPOCH_SIZE="2", PYTHON=PYTHON)
    res = procs.run(["bash", str(ROOT / "examples/run.sh"), str(data)], env, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + (tmp_path / "worker_0.txt").read_text()
    logs = [(tmp_path / f"worker_{i}.txt").read_text() for i in range(2)]
    for log in logs:  # sink mode: one line per epoch, with the epoch's step count
        assert re.findall(r"epoch: (\d) step: 6, loss is \d", log) == ["1", "2"], log
    assert "job succeeded" in (tmp_path / "scheduler.txt").read_text()
    assert not procs.wait_no_leftovers()


def test_sbatch_example_is_valid_and_names_the_tutorial_script(procs):
    """No SLURM here: the script parses, asks for its one argument, and srun starts a script that exists (what srun
    exports to each task is run for real across hosts in tests/cluster/test_netns_hosts.py)."""
    path = ROOT / "examples/train.sbatch"
    assert procs.run(["bash", "-n", str(path)], timeout=30).returncode == 0
    res = procs.run(["bash", str(path)], timeout=30)
    assert res.returncode != 0 and "usage: sbatch examples/train.sbatch DATA_PATH" in res.stderr
    text = path.read_text()
    assert re.search(r"#SBATCH --ntasks-per-node=\d+", text)
    script = re.search(r'srun .*"\$SCRIPT_DIR/(\S+)"', text)[1]
    assert (ROOT / "examples" / script).is_file()


def test_tutorial_run_sh_without_data_says_why_it_failed(procs, tmp_path):
    """Without DATA_PATH the job fails; the script's last line is the scheduler's verdict (every rank's missing
    files, said once), not only 'job finished with status 1'."""
    env = procs.env(WORKER_NUM="2", SCHED_PORT=str(free_port()), PYTHON=PYTHON)
    res = procs.run(["bash", str(ROOT / "examples/run.sh")], env, timeout=300, cwd=tmp_path)
    assert res.returncode == 1, res.stdout + res.stderr
    last = res.stdout.strip().splitlines()[-1]
    assert last.startswith("scheduler.txt: autopar: error: job failed (every rank (0, 1) on "), res.stdout
    assert last.count("Cifar10Dataset: missing data_batch_1.bin") == 1, last
    assert not procs.wait_no_leftovers()
