"""``autopar launch`` as a drop-in for torchrun, and ``msrun`` (MindSpore 2.3+'s launcher) as its alias."""
import re
import time

import torch

from autopar.cluster.netutil import free_port
from procutil import PYTHON, SCRIPTS, autopar_cmd

TORCHRUN_STYLE = str(SCRIPTS / "torchrun_style.py")
JOB = str(SCRIPTS / "job.py")


def test_a_torchrun_script_forms_one_world(procs, tmp_path):
    res = procs.run(autopar_cmd("launch", "-n", "2", "--log-dir", str(tmp_path / "logs"), TORCHRUN_STYLE,
                                str(tmp_path)), timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    got = [torch.load(tmp_path / f"rank_{r}.pt") for r in range(2)]
    assert [g["world"] for g in got] == [2, 2] and [g["rank_sum"] for g in got] == [1.0, 1.0]  # one world of 2
    assert [g["local_rank"] for g in got] == [0, 1]
    for a, b in zip(got[0]["params"], got[1]["params"]):  # DDP kept the replicas equal through AdamW steps
        assert torch.equal(a, b)
    env = (tmp_path / "logs" / "env_1.log").read_text()
    for var in ("RANK=1", "LOCAL_RANK=1", "WORLD_SIZE=2", "LOCAL_WORLD_SIZE=2", "GROUP_RANK=0",
                "MASTER_ADDR=127.0.0.1"):
        assert f"\n{var}\n" in f"\n{env}", var
    torch_port = re.search(r"\nMASTER_PORT=(\d+)\n", env)[1]
    sched_port = re.search(r"\nMS_SCHED_PORT=(\d+)\n", env)[1]
    assert torch_port != sched_port  # torch's store has a port of its own
    assert not procs.wait_no_leftovers()


def test_a_torchrun_script_across_two_nodes(procs, tmp_path):
    """Two launchers (--nnodes 2 on loopback): one world of 4, ranks node by node, GROUP_RANK the node."""
    port, token = free_port(), "0123456789abcdef"
    common = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port), "--token", token, "-n", "2"]
    nodes = [procs.start(autopar_cmd("launch", *common, "--node-rank", str(k), "--log-dir", str(tmp_path / f"n{k}"),
                                     TORCHRUN_STYLE, str(tmp_path)), log=tmp_path / f"launcher{k}.log")
             for k in range(2)]
    assert [p.wait(timeout=180) for p in nodes] == [0, 0], [(tmp_path / f"launcher{k}.log").read_text() for k in (0, 1)]
    got = [torch.load(tmp_path / f"rank_{r}.pt") for r in range(4)]
    assert {g["world"] for g in got} == {4} and {g["rank_sum"] for g in got} == {6.0}
    assert [g["local_rank"] for g in got] == [0, 1, 0, 1]
    for g in got[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got[0]["params"], g["params"]))
    assert "GROUP_RANK=1\n" in (tmp_path / "n1" / "env_3.log").read_text()
    assert f"MASTER_PORT={port + 1}\n" in (tmp_path / "n1" / "env_3.log").read_text()
    assert not procs.wait_no_leftovers()


def test_a_torchrun_script_whose_rank_dies(procs, tmp_path):
    res = procs.run(autopar_cmd("launch", "-n", "2", "--log-dir", str(tmp_path / "logs"), TORCHRUN_STYLE,
                                str(tmp_path)), procs.env(FAIL_RANK="1"), timeout=180)
    assert res.returncode == 137, res.stdout + res.stderr
    assert "autopar: error: rank 1 failed: killed by signal SIGKILL" in res.stderr, res.stderr
    assert "rank 0 failed" not in res.stderr
    assert not procs.wait_no_leftovers()


def test_autopar_init_keeps_its_contract_and_adopts_a_torch_world(procs, tmp_path):
    """Under the launcher autopar's init() still reads the MindSpore variables first (job.py prints the contract);
    after the script's own init_process_group, init() joins that world instead of forming a second one."""
    res = procs.run(autopar_cmd("launch", "-n", "2", "--log-dir", str(tmp_path / "a"), JOB), timeout=180)
    assert res.returncode == 0 and "RANK 0 OF 2 local 0/2 contract mindspore" in res.stdout, res.stderr
    script = tmp_path / "both.py"
    script.write_text("import torch.distributed as dist, autopar\n"
                      "dist.init_process_group('gloo')\n"
                      "autopar.init()\n"
                      "print('WORLD', autopar.get_rank(), autopar.get_group_size(), autopar.get_local_rank(),"
                      " flush=True)\n")
    res = procs.run(autopar_cmd("launch", "-n", "2", "--log-dir", str(tmp_path / "b"), str(script)), timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "WORLD 1 2 1" in (tmp_path / "b" / "worker_1.log").read_text()
    assert not procs.wait_no_leftovers()


def msrun(*flags):
    return [PYTHON, "-m", "autopar.cli.msrun", *flags]


def test_msrun_two_workers_joined_and_in_the_background(procs, tmp_path):
    logs = tmp_path / "msrun_log"
    res = procs.run(msrun("--worker_num=2", "--local_worker_num=2", f"--master_port={free_port()}",
                          f"--log_dir={logs}", "--join=True", "--cluster_time_out=60", JOB), timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    assert sorted(p.name for p in logs.glob("*.log") if not p.name.startswith("env_")) == \
        ["scheduler.log", "worker_0.log", "worker_1.log"]  # MindSpore's log layout
    for r in range(2):
        assert f"RANK {r} OF 2 local {r}/2 contract mindspore" in (logs / f"worker_{r}.log").read_text()
    assert "AUTOPAR_CLUSTER_TIMEOUT=60\n" in (logs / "env_0.log").read_text()
    # --join=False (MindSpore's default): msrun returns at once, the job goes on and ends by itself
    back = tmp_path / "back"
    t0 = time.monotonic()
    res = procs.run(msrun("--worker_num=2", "--local_worker_num=2", f"--master_port={free_port()}",
                          f"--log_dir={back}", JOB), procs.env(JOB_STEPS="40"), timeout=60)
    assert res.returncode == 0 and "runs in the background" in res.stdout, res.stdout + res.stderr
    assert time.monotonic() - t0 < 30
    deadline = time.monotonic() + 180
    while "job finished" not in ((back / "msrun.log").read_text() if (back / "msrun.log").exists() else ""):
        assert time.monotonic() < deadline, "the background job never finished"
        time.sleep(0.5)
    assert "job finished: exit 0" in (back / "msrun.log").read_text()
    assert "RANK 1 DONE" in (back / "worker_1.log").read_text()
    assert not procs.wait_no_leftovers()


def test_msrun_bad_flags_are_one_line(procs, tmp_path, capsys):
    from autopar.cli.msrun import main

    cases = [
        (["--worker_num=2", "--local_worker_num=3"], "--local_worker_num=3 is more than --worker_num=2"),
        (["--worker_num=5", "--local_worker_num=2", "--node_rank=0"], "is not a multiple of --local_worker_num"),
        (["--worker_num=4", "--local_worker_num=2"], "2 nodes: give --node_rank"),
        (["--worker_num=2", "--local_worker_num=2", "--sim_level=2"], "--sim_level=2: autopar simulates levels 0"),
        (["--worker_num=2", "--local_worker_num=2", "--master_port=70000"], "--master_port=70000 is not in"),
        (["--worker_num=2", "--local_worker_num=2", "--join=maybe"], "argument --join: expected True or False"),
    ]
    for flags, message in cases:  # msrun's own entry, in this process: these fail before starting anything
        try:
            code = main([*flags, f"--log_dir={tmp_path}", JOB])
        except SystemExit as exc:  # argparse's own errors
            code = exc.code
        err = capsys.readouterr().err
        assert code == 2, (flags, err)
        assert "msrun: error:" in err and message in err and "Traceback" not in err, (flags, err)
    res = procs.run(msrun("--worker_num=1", "--local_worker_num=1", "--bind_core=True", "--join=True",
                          f"--master_port={free_port()}", f"--log_dir={tmp_path / 'w'}", JOB),
                    procs.env(JOB_STEPS="1"), timeout=120)
    assert res.returncode == 0 and "msrun: warning: --bind_core=True is accepted but not applied" in res.stderr
