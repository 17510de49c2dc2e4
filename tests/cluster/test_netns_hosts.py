"""Issue 19: several hosts for real -- each host a network namespace with its own address (see tests/netns.py).

The tutorial-style DATA_PARALLEL job (tests/scripts/restart_job.py) on 2 hosts x 2 ranks, formed five ways (the
MindSpore contract by hand with the scheduler on a third host, an r1.x rank table of the hosts' addresses, a hostfile
of host names, srun's task variables, and launch --nnodes with a pulled cable and --max-restarts), ends with the same
parameters as the same job on one host. Then faults (a cable pulled, a host's processes killed) and security (the
listening addresses, a stranger on a third host).
"""
import json
import re
import signal
import time

import psutil
import pytest
import torch

from netns import NetnsCluster, unavailable
from procutil import PYTHON, SCRIPTS, autopar_cmd

TRAIN = str(SCRIPTS / "restart_job.py")
JOB = str(SCRIPTS / "job.py")
TOKEN = "0123456789abcdef0123456789abcdef"
PORT = "29517"  # every host has its own port space: no other job on this machine can hold it


@pytest.fixture(scope="module")
def hosts():
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    cluster = NetnsCluster(3)
    yield cluster
    cluster.close()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same job, 4 ranks on one host (loopback)."""
    from procutil import Procs

    root = tmp_path_factory.mktemp("one_host")
    procs = Procs()
    try:
        res = procs.run(autopar_cmd("launch", "-n", "4", "--log-dir", str(root / "logs"), TRAIN, str(root)),
                        timeout=240)
    finally:
        procs.kill_all()
    assert res.returncode == 0, res.stdout + res.stderr
    return torch.load(root / "final.pt")


def same_as_reference(root, reference):
    final = torch.load(root / "final.pt")
    worst = max((final[k] - v).abs().max().item() for k, v in reference.items())
    assert worst <= 1e-6, worst


def finish(popens, timeout=240):
    return [p.wait(timeout=timeout) for p in popens]


def test_mindspore_contract_with_the_scheduler_on_a_third_host(procs, hosts, reference, tmp_path):
    contract = dict(MS_WORKER_NUM="4", MS_SCHED_HOST=hosts.addresses[2], MS_SCHED_PORT=PORT)
    sched = procs.start(hosts.cmd(2, [PYTHON, TRAIN, str(tmp_path)]), procs.env(MS_ROLE="MS_SCHED", **contract),
                        log=tmp_path / "scheduler.log")
    workers = [procs.start(hosts.cmd(k // 2, [PYTHON, TRAIN, str(tmp_path)]),
                           procs.env(MS_ROLE="MS_WORKER", **contract), log=tmp_path / f"worker{k}.log")
               for k in range(4)]
    assert finish(workers + [sched]) == [0] * 5, (tmp_path / "scheduler.log").read_text()
    same_as_reference(tmp_path, reference)
    # the scheduler told every rank who shares its host: local ranks 0, 1 on each of the two worker hosts
    assert "job succeeded" in (tmp_path / "scheduler.log").read_text()


def rank_table(hosts, path):
    servers = [{"server_id": hosts.addresses[k], "host_nic_ip": "reserve",
                "device": [{"device_id": str(d), "device_ip": f"192.98.{k}.{d}", "rank_id": str(2 * k + d)}
                           for d in range(2)]} for k in range(2)]
    path.write_text(json.dumps({"version": "1.0", "server_count": "2", "status": "completed", "server_list": servers}))
    return str(path)


def test_rank_table_of_the_hosts_addresses(procs, hosts, reference, tmp_path):
    table = rank_table(hosts, tmp_path / "rank_table_4pcs.json")
    nodes = [procs.start(hosts.cmd(k, autopar_cmd("launch", "--rank-table", table, "--server-id", hosts.addresses[k],
                                                  "--log-dir", str(tmp_path / f"n{k}"), TRAIN, str(tmp_path))),
                         procs.env(MASTER_PORT=PORT), log=tmp_path / f"launcher{k}.log") for k in range(2)]
    assert finish(nodes) == [0, 0], [(tmp_path / f"launcher{k}.log").read_text() for k in range(2)]
    same_as_reference(tmp_path, reference)
    assert "DEVICE_ID=1\n" in (tmp_path / "n1" / "env_3.log").read_text()


def test_hostfile_of_host_names_finds_each_node_itself(procs, hosts, reference, tmp_path):
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text(f"# two nodes\n{hosts.names[0]} slots=2\n{hosts.names[1]} slots=2\n")
    nodes = [procs.start(hosts.cmd(k, autopar_cmd("launch", "--hostfile", str(hostfile), "--master-port", PORT,
                                                  "--token", TOKEN, "--log-dir", str(tmp_path / f"n{k}"), TRAIN,
                                                  str(tmp_path))),
                         log=tmp_path / f"launcher{k}.log") for k in range(2)]
    assert finish(nodes) == [0, 0], [(tmp_path / f"launcher{k}.log").read_text() for k in range(2)]
    same_as_reference(tmp_path, reference)
    assert (tmp_path / "n1" / "worker_3.log").exists() and not (tmp_path / "n1" / "scheduler.log").exists()


def test_srun_tasks_on_two_hosts_find_the_first_node_of_the_nodelist(procs, hosts, reference, tmp_path):
    """What srun exports to each of its 4 tasks (2 per node); node names resolve on each host as through DNS."""
    nodelist = f"{hosts.names[0][:-2]}[{hosts.names[0][-2:]}-{hosts.names[1][-2:]}]"  # node[01-02]
    tasks = []
    for rank in range(4):
        env = procs.env(SLURM_PROCID=rank, SLURM_NTASKS=4, SLURM_LOCALID=rank % 2, SLURM_NODEID=rank // 2,
                        SLURM_JOB_NODELIST=nodelist, SLURM_TASKS_PER_NODE="2(x2)", SLURM_JOB_ID=4242, SLURM_STEP_ID=0)
        tasks.append(procs.start(hosts.cmd(rank // 2, [PYTHON, TRAIN, str(tmp_path)]), env,
                                 log=tmp_path / f"task{rank}.log"))
    assert finish(tasks) == [0] * 4, [(tmp_path / f"task{r}.log").read_text() for r in range(4)]
    same_as_reference(tmp_path, reference)


def start_long_job(procs, hosts, tmp_path, **env):
    nodes = [procs.start(hosts.cmd(k, autopar_cmd(
        "launch", "-n", "2", "--nnodes", "2", "--node-rank", str(k), "--master-addr", hosts.addresses[0],
        "--master-port", PORT, "--token", TOKEN, "--log-dir", str(tmp_path / f"n{k}"), JOB)),
        procs.env(JOB_STEPS="100000", JOB_SLEEP="0.05", AUTOPAR_HEARTBEAT_TIMEOUT="5", **env),
        log=tmp_path / f"launcher{k}.log")
        for k in range(2)]
    deadline = time.monotonic() + 120
    log = tmp_path / "n0" / "scheduler.log"
    while not (log.exists() and "all 4 workers joined" in log.read_text()):
        assert time.monotonic() < deadline and all(p.poll() is None for p in nodes), \
            [(tmp_path / f"launcher{k}.log").read_text() for k in range(2)]
        time.sleep(0.2)
    time.sleep(1.0)  # a few steps
    return nodes


def ends_within(popens, seconds):
    """Exit codes of ``popens``, all of which must end within ``seconds`` from now."""
    deadline = time.monotonic() + seconds
    return [p.wait(timeout=max(0.1, deadline - time.monotonic())) for p in popens]


@pytest.mark.timeout(240)
def test_a_pulled_cable_ends_both_hosts_naming_the_lost_one(procs, hosts, tmp_path):
    nodes = start_long_job(procs, hosts, tmp_path)
    hosts.cut(1)
    try:
        code0, code1 = ends_within(nodes, 60)
    finally:
        hosts.restore(1)
    out0, out1 = (tmp_path / "launcher0.log").read_text(), (tmp_path / "launcher1.log").read_text()
    assert code0 != 0 and code1 != 0
    # node 0 names the host it lost and its ranks; node 1 says it lost the scheduler
    assert re.search(r"host \S+ \(10\.77\.0\.2\) lost: ranks 2, 3", out0), out0
    assert f"lost the scheduler at {hosts.addresses[0]}:{PORT}" in out1, out1
    assert not procs.wait_no_leftovers()


@pytest.mark.timeout(240)
def test_strangers_refused_then_a_host_whose_processes_are_all_killed(procs, hosts, tmp_path):
    nodes = start_long_job(procs, hosts, tmp_path)
    # security: the scheduler (and gloo) listen on the given address only; a process on a third host with a wrong
    # token or none is refused and never gets a rank, while the job runs on
    listening = hosts.listening(0)
    assert f"{hosts.addresses[0]}:{PORT}" in listening
    assert not [a for a in listening if a.startswith(("0.0.0.0:", "*:", "[::]:"))], listening
    joiners = []
    for token in ("wrong", ""):
        env = procs.env(MS_ROLE="MS_WORKER", MS_WORKER_NUM="4", MS_SCHED_HOST=hosts.addresses[0], MS_SCHED_PORT=PORT,
                        AUTOPAR_JOB_TOKEN=token)
        joiners.append(procs.start(hosts.cmd(2, [PYTHON, JOB]), env, log=tmp_path / f"joiner{len(joiners)}.log"))
    for i, joiner in enumerate(joiners):
        assert joiner.wait(timeout=60) != 0
        out = (tmp_path / f"joiner{i}.log").read_text()
        assert "autopar: error: refused: this process does not carry the job's token" in out and "RANK" not in out
    assert all(p.poll() is None for p in nodes)
    # then every process of host 1 is killed at once, its launcher included
    victims = [p for p in psutil.process_iter(["environ"]) if (p.info["environ"] or {}).get("AUTOPAR_TEST_TAG") ==
               procs.tag and (p.info["environ"] or {}).get("AUTOPAR_HOST_ID", "").endswith("(10.77.0.2)")]
    victims.append(psutil.Process(nodes[1].pid))
    for p in victims:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    code0, = ends_within(nodes[:1], 60)
    out0 = (tmp_path / "launcher0.log").read_text()
    assert code0 != 0 and re.search(r"host \S+ \(10\.77\.0\.2\) lost: ranks 2, 3", out0), out0
    assert not procs.wait_no_leftovers()


@pytest.mark.timeout(300)
def test_max_restarts_resumes_across_hosts_once_the_cable_is_back(procs, hosts, reference, tmp_path):
    env = procs.env(STEP_SLEEP="3", AUTOPAR_HEARTBEAT_TIMEOUT="4")
    nodes = [procs.start(hosts.cmd(k, autopar_cmd(
        "launch", "-n", "2", "--nnodes", "2", "--node-rank", str(k), "--master-addr", hosts.addresses[0],
        "--master-port", PORT, "--token", TOKEN, "--max-restarts", "1", "--log-dir", str(tmp_path / f"n{k}"), TRAIN,
        str(tmp_path))), env, log=tmp_path / f"launcher{k}.log") for k in range(2)]
    logs = [tmp_path / f"launcher{k}.log" for k in range(2)]

    def wait(condition, what):
        deadline = time.monotonic() + 120
        while not condition():
            assert time.monotonic() < deadline and all(p.poll() is None for p in nodes), \
                (what, [log.read_text() for log in logs])
            time.sleep(0.2)

    wait(lambda: all((tmp_path / f"ckpt_{r}" / "job-1_2.ckpt").exists() for r in range(4)), "step 2's checkpoints")
    hosts.cut(1)
    try:
        wait(lambda: all("restart 1 of 1" in log.read_text() for log in logs), "both nodes restarting")
    finally:
        hosts.restore(1)
    assert finish(nodes) == [0, 0], [log.read_text() for log in logs]
    assert json.loads((tmp_path / "steps_1.json").read_text()) == [3, 4]  # resumed after step 2
    # gloo was pointed at the interface that reaches the scheduler in the worker, not forced by the launcher
    assert "GLOO_SOCKET_IFNAME" not in (tmp_path / "n1" / "env_2.log").read_text()
    same_as_reference(tmp_path, reference)
    assert "lost: ranks 2, 3" in logs[0].read_text()
    assert not procs.wait_no_leftovers()


def test_a_rank_table_job_listens_on_the_table_address_only(procs, hosts, tmp_path):
    """No scheduler here: rank 0 hosts the rendezvous itself, and it too listens on the master address only."""
    table = rank_table(hosts, tmp_path / "rank_table_4pcs.json")
    env = procs.env(MASTER_PORT=PORT, JOB_STEPS="100000", JOB_UNTIL_FILE=str(tmp_path / "finish"))
    nodes = [procs.start(hosts.cmd(k, autopar_cmd("launch", "--rank-table", table, "--server-id", hosts.addresses[k],
                                                  "--log-dir", str(tmp_path / f"n{k}"), JOB)),
                         env, log=tmp_path / f"launcher{k}.log") for k in range(2)]
    deadline = time.monotonic() + 120
    while "RANK 0 OF 4" not in (tmp_path / "launcher0.log").read_text():
        assert time.monotonic() < deadline and all(p.poll() is None for p in nodes)
        time.sleep(0.2)
    listening = hosts.listening(0)
    (tmp_path / "finish").touch()
    assert finish(nodes, 120) == [0, 0]
    assert f"{hosts.addresses[0]}:{PORT}" in listening
    assert not [a for a in listening if a.startswith(("0.0.0.0:", "*:", "[::]:"))], listening
