"""Issue 19: the cluster schedulers' environments -- SLURM (srun), a Kubernetes indexed Job, PyTorchJob/torchrun --
read by init() after the explicit contracts, and their bad input as one-line errors."""
import pytest

from autopar.cluster.env import detect_cluster_env
from autopar.cluster.slurm import expand_nodelist, expand_tasks_per_node
from autopar.errors import ClusterError
from procutil import PYTHON, SCRIPTS


@pytest.mark.parametrize("text, hosts", [
    ("node07", ["node07"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("node[8-11]", ["node8", "node9", "node10", "node11"]),
    ("gpu[098-101]", ["gpu098", "gpu099", "gpu100", "gpu101"]),
    ("a[1-2],login,b[3]", ["a1", "a2", "login", "b3"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("10.0.0.[1-2]", ["10.0.0.1", "10.0.0.2"]),
])
def test_nodelists_expand_as_slurm_writes_them(text, hosts):
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("text, fragment", [
    ("node[01-04", "'[' without ']'"), ("node01]", "']' without '['"), ("node[4-1]", "runs backwards"),
    ("node[a-b]", "is not a number or a range"), ("node[[1]]", "nested brackets"), ("a,,b", "an empty name"),
    ("", "is empty"),
])
def test_a_nodelist_that_does_not_parse_is_named(text, fragment):
    with pytest.raises(ClusterError, match="SLURM_JOB_NODELIST") as err:
        expand_nodelist(text)
    assert fragment in str(err.value)


def test_tasks_per_node():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(ClusterError, match=r"SLURM_TASKS_PER_NODE='2\(3\)'"):
        expand_tasks_per_node("2(3)")


def srun_env(rank, world=4, per_node=2, **extra):
    env = {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(world), "SLURM_LOCALID": str(rank % per_node),
           "SLURM_NODEID": str(rank // per_node), "SLURM_JOB_NODELIST": "node[01-02]",
           "SLURM_TASKS_PER_NODE": f"{per_node}(x{world // per_node})", "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0"}
    env.update(extra)
    return env


def test_srun_task_environment():
    c = detect_cluster_env(srun_env(3))
    assert (c.contract, c.world_size, c.rank, c.local_rank, c.local_size, c.master_addr) == \
        ("slurm", 4, 3, 1, 2, "node01")
    assert 20000 <= c.master_port < 40000 and c.master_port == detect_cluster_env(srun_env(0)).master_port
    assert detect_cluster_env(srun_env(0, SLURM_STEP_ID="1")).master_port != c.master_port  # steps differ
    override = detect_cluster_env(srun_env(1, MASTER_ADDR="10.1.1.1", MASTER_PORT="1234"))
    assert (override.master_addr, override.master_port) == ("10.1.1.1", 1234)
    step = detect_cluster_env(srun_env(0, SLURM_STEP_NODELIST="node02", SLURM_STEP_TASKS_PER_NODE="4"))
    assert (step.master_addr, step.local_size) == ("node02", 4)


def test_explicit_contracts_win_over_an_enclosing_allocation():
    """mpirun, torchrun or autopar launch inside an sbatch script: their processes inherit SLURM_PROCID=0."""
    batch = srun_env(0)
    assert detect_cluster_env({**batch, "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4"}).contract == "openmpi"
    assert detect_cluster_env({**batch, "RANK": "1", "WORLD_SIZE": "2"}).contract == "torchrun"
    assert detect_cluster_env({**batch, "MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": "2",
                               "MS_SCHED_PORT": "1"}).contract == "mindspore"


def test_kubernetes_environments():
    pytorchjob = {"RANK": "2", "WORLD_SIZE": "4", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456",
                  "KUBERNETES_SERVICE_HOST": "10.96.0.1"}
    c = detect_cluster_env(pytorchjob)
    assert (c.contract, c.rank, c.master_addr, c.master_port) == ("torchrun", 2, "job-master-0", 23456)
    indexed = {"JOB_COMPLETION_INDEX": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "train-0.train"}
    c = detect_cluster_env(indexed)
    assert (c.contract, c.rank, c.world_size, c.master_addr) == ("kubernetes", 3, 4, "train-0.train")


@pytest.mark.parametrize("env, message", [
    (srun_env(4), "SLURM_PROCID=4 is beyond the world size SLURM_NTASKS=4"),
    (srun_env(0, SLURM_NTASKS="x"), "SLURM_NTASKS='x' is not an integer"),
    (srun_env(0, SLURM_JOB_NODELIST="node[01-"), "SLURM_JOB_NODELIST: '[' without ']'"),
    (srun_env(0, SLURM_TASKS_PER_NODE="2(x1)", SLURM_NODEID="1"), "SLURM_NODEID=1 but SLURM_TASKS_PER_NODE"),
    ({"JOB_COMPLETION_INDEX": "0", "WORLD_SIZE": "2"}, "needs MASTER_ADDR"),
])
def test_bad_scheduler_environments(env, message):
    with pytest.raises(ClusterError) as err:
        detect_cluster_env(env)
    assert message in str(err.value)


def test_a_bad_nodelist_is_one_line_from_init(procs):
    res = procs.run([PYTHON, str(SCRIPTS / "job.py")], procs.env(**srun_env(1, SLURM_JOB_NODELIST="node[01-")),
                    timeout=60)
    assert res.returncode != 0
    assert res.stderr.strip().splitlines()[-1].startswith("autopar: error: SLURM_JOB_NODELIST: '[' without ']'")
    assert "Traceback" not in res.stderr


def test_a_master_that_does_not_answer_is_named_within_the_timeout(procs):
    # 203.0.113.0/24 is TEST-NET-3: reserved for documentation, never routed to a host (TEST-NET-1, 192.0.2.0/24,
    # is some sandboxes' own subnet, where the address answers "no route to host" at once instead)
    env = procs.env(**srun_env(1, SLURM_JOB_NODELIST="203.0.113.[7-8]"), AUTOPAR_CLUSTER_TIMEOUT="5")
    res = procs.run([PYTHON, str(SCRIPTS / "job.py")], env, timeout=60)
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "autopar: error: cannot reach rank 0 at 203.0.113.7:" in res.stderr, res.stderr


def test_a_rank_table_whose_first_server_does_not_answer(procs, tmp_path):
    """This host holds ranks 2-3; rank 0's server (the rendezvous) is an address nobody answers on."""
    import json

    from procutil import autopar_cmd

    servers = [{"server_id": sid, "device": [{"device_id": str(d), "device_ip": f"192.98.{k}.{d}",
                                             "rank_id": str(2 * k + d)} for d in range(2)]}
               for k, sid in enumerate(["203.0.113.7", "203.0.113.9"])]
    table = tmp_path / "rank_table.json"
    table.write_text(json.dumps({"version": "1.0", "server_count": "2", "status": "completed", "server_list": servers}))
    env = procs.env(MASTER_PORT="29555", AUTOPAR_CLUSTER_TIMEOUT="5", JOB_STEPS="1")
    res = procs.run(autopar_cmd("launch", "--rank-table", str(table), "--server-id", "203.0.113.9", "--log-dir",
                                str(tmp_path / "logs"), str(SCRIPTS / "job.py")), env, timeout=90)
    assert res.returncode != 0
    # the launcher's report is what the user reads; which worker it quotes depends on which gave up first (a
    # slow host may stop the other before it has written a line), so the report is checked, not one worker's log
    logs = {p.name: p.read_text() for p in (tmp_path / "logs").glob("worker_*.log")}
    assert "cannot reach rank 0 at 203.0.113.7:29555 within 5 s" in res.stderr, (res.stderr, logs)
    assert res.stderr.startswith("autopar: error: ") and "Traceback" not in res.stderr, res.stderr
