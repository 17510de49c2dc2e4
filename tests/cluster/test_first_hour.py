"""What a new user sees: every rank's lines on the console, one line saying which parallel mode ran, torchrun's flags,
and an error every rank hit said once, in the user's words -- each checked on a launched job's console and logs."""
from __future__ import annotations

import re
import textwrap

import pytest

from procutil import PYTHON, SCRIPTS, autopar_cmd

# The README's PyTorch loop; MODE picks the parallel mode the way the docs turn it into tensor parallel or ZeRO-3.
LOOP = textwrap.dedent("""
    import sys
    import torch
    import autopar

    mode, width = sys.argv[1], int(sys.argv[2])
    autopar.init()
    zero = {"enable_parallel_optimizer": True, "parallel_optimizer_config": {"optimizer_level": "level3"}}
    autopar.set_auto_parallel_context(parallel_mode="semi_auto_parallel" if mode == "tp" else "data_parallel",
                                      gradients_mean=True, **(zero if mode == "zero3" else {}))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))
    if mode == "tp":
        autopar.shard(net[0], "colwise")
        autopar.shard(net[2], "rowwise")
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(autopar.get_rank())
    for step in range(3):
        x = torch.randn(16, 8, generator=data)
        loss = torch.nn.functional.mse_loss(net(x), x.sum(1, keepdim=True))
        opt.zero_grad(); loss.backward(); opt.step()
    print(f"rank {autopar.get_rank()} of {autopar.get_group_size()}: loss {loss.item():.3f}")
""")


@pytest.fixture
def loop(tmp_path):
    path = tmp_path / "loop.py"
    path.write_text(LOOP)
    return str(path)


def _launch(procs, tmp_path, name, flags: list[str], script: list[str], timeout=120):
    logs = tmp_path / name
    res = procs.run(autopar_cmd("launch", *flags, "--log-dir", str(logs), *script), timeout=timeout)
    return res, logs


def test_every_rank_is_heard_and_one_line_says_which_mode_ran(procs, tmp_path, loop):
    expected = {
        "dp": "data_parallel on 2 ranks: mesh dp 2 x tp 1 x pp 1; no ZeRO; every parameter whole on every rank; "
              "gradients: bucketed all-reduce",
        "tp": 'semi_auto_parallel on 2 ranks: mesh dp 1 x tp 2 x pp 1; no ZeRO; split: 0 (Linear) "colwise", '
              '2 (Linear) "rowwise"; gradients: layout redistribution',
        "zero3": "data_parallel on 2 ranks: mesh dp 2 x tp 1 x pp 1; ZeRO-3 (parameters, gradients and optimizer "
                 "state sharded over 2 ranks); gradients: ZeRO (FSDP2 reduce-scatter)",
    }
    for mode, line in expected.items():
        # torchrun's spelling of -n for one of them: a torchrun command line works with the name swapped
        flag = "--nproc_per_node" if mode == "tp" else "-n"
        res, logs = _launch(procs, tmp_path, mode, [flag, "2"], [loop, mode, "16"])
        assert res.returncode == 0, res.stdout + res.stderr
        out = res.stdout.splitlines()
        said = [x for x in out if "[autopar] " in x and " on 2 ranks: " in x]
        assert len(said) == 1 and said[0].startswith(f"[rank 0] [autopar] {line}"), (said, line)
        assert (logs / "parallel.txt").read_text().startswith(line), mode
        assert line in (logs / "worker_0.log").read_text()
        for rank in (0, 1):  # every rank's own line, prefixed with its rank
            assert any(re.fullmatch(rf"\[rank {rank}\] rank {rank} of 2: loss \d+\.\d+", x) for x in out), res.stdout
    # narrowed to rank 0 (torchrun's --local-ranks-filter): its lines bare, rank 1's only in its log
    res, logs = _launch(procs, tmp_path, "narrow", ["-n", "2", "--local-ranks-filter", "0"], [loop, "dp", "16"])
    assert res.returncode == 0, res.stderr
    assert re.search(r"^rank 0 of 2: loss", res.stdout, re.M) and "rank 1 of 2" not in res.stdout, res.stdout
    assert "rank 1 of 2: loss" in (logs / "worker_1.log").read_text()


def test_an_error_every_rank_hits_is_said_once_in_the_users_words(procs, tmp_path, loop):
    res, logs = _launch(procs, tmp_path, "bad", ["-n", "2"], [loop, "tp", "15"])
    assert res.returncode == 1, res.stdout + res.stderr
    said = 'module \'0\' (Linear) split "colwise" over 2 ranks: its output features (15) cannot be split into 2 parts'
    console = res.stdout + res.stderr
    assert console.count("cannot be split into 2 parts") == 1, console  # not once per rank and again in each log's tail
    assert re.search(rf"^autopar: error: (every rank \(0, 1\)|rank [01]) failed: {re.escape(said)}", res.stderr,
                     re.M), res.stderr
    assert "_autopar_op" not in console and "LinearOp" not in console
    assert "mesh dp" not in console  # a forward that failed announces no mode


def test_torchrun_flags_act_or_say_what_autopar_takes(procs, tmp_path, loop):
    job = str(SCRIPTS / "job.py")
    res, logs = _launch(procs, tmp_path, "rdzv", ["--nproc-per-node", "2", "--standalone", "--rdzv-backend", "c10d",
                                                 "--rdzv-conf", "join_timeout=77", "--max_restarts", "0", "--tee",
                                                 "3"], [job])
    assert res.returncode == 0, res.stdout + res.stderr
    assert "AUTOPAR_CLUSTER_TIMEOUT=77\n" in (logs / "env_1.log").read_text()
    assert "autopar launch: warning: --tee (torchrun's) is ignored" in res.stderr, res.stderr
    assert "[rank 1] RANK 1 OF 2" in res.stdout
    cases = [
        (["-m", "mypkg.train"], "autopar: error: --module (torchrun's) is not supported: autopar launch runs a "
                                "script file"),
        (["--rdzv-backend", "etcd", loop], "autopar: error: --rdzv-backend etcd is not supported"),
        (["--nnodes", "1:4", loop], "autopar launch: error: argument --nnodes: '1:4': autopar runs a fixed number "
                                    "of nodes"),
        (["--standalone", "--nnodes", "2", loop], "autopar: error: --standalone is one node, but --nnodes is 2"),
        (["--bogus", "2", loop], "autopar launch: error: unrecognized arguments: --bogus"),
    ]
    for args, line in cases:
        res = procs.run(autopar_cmd("launch", *args), timeout=60)
        assert res.returncode == 2 and line in res.stderr, (args, res.stderr)
        assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) <= 20, res.stderr
        if "usage" in res.stderr:  # the sub-command's usage, not the top level's
            assert res.stderr.startswith("usage: autopar launch"), res.stderr


def test_train_checks_its_data_before_starting_workers(procs, tmp_path):
    res = procs.run(autopar_cmd("train", "-n", "2", "--data", str(tmp_path / "nonexistent"), "--log-dir",
                                str(tmp_path / "logs")), timeout=60)
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.strip() == (f"autopar: error: --data {tmp_path / 'nonexistent'}: no such directory (give the "
                                  "folder holding cifar-10-batches-bin, or --synthetic to generate one)")
    assert "launched" not in res.stdout
    res = procs.run(autopar_cmd("train", "-n", "2", "--data", str(tmp_path), "--log-dir", str(tmp_path / "logs")),
                    timeout=60)
    assert res.returncode == 2 and "missing data_batch_1.bin" in res.stderr and "launched" not in res.stdout


STRATEGY_FILE_JOB = textwrap.dedent("""
    import sys
    import torch
    import autopar
    from autopar.errors import StrategyError

    autopar.init()
    path = sys.argv[1]
    for width, key in ((6, "strategy_ckpt_save_file"), (5, "strategy_ckpt_load_file")):
        autopar.reset_auto_parallel_context()
        autopar.set_auto_parallel_context(parallel_mode="semi_auto_parallel", **{key: path})
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, width))
        if width == 6:
            autopar.shard(net[2], ((1, 1), (2, 1)))
        try:
            net(torch.randn(4, 8)).sum().backward()
        except StrategyError as exc:
            print("ERROR", exc)
""")


def test_a_strategy_file_of_another_network_names_the_weight_and_both_shapes(procs, tmp_path):
    script = tmp_path / "sf.py"
    script.write_text(STRATEGY_FILE_JOB)
    path = tmp_path / "strategy.json"
    res, logs = _launch(procs, tmp_path, "sf", ["-n", "2"], [str(script), str(path)])
    assert res.returncode == 0, res.stdout + res.stderr
    line = (f"ERROR the strategy file {path} was written for parameter '2.weight' of shape (6, 16), the network's "
            f"has (5, 16)")
    assert line in (logs / "worker_1.log").read_text(), (logs / "worker_1.log").read_text()


def test_rank_table_r02_run_sh_sets_device_id_but_no_rank_id(procs, tmp_path):
    """MindSpore r0.2's run.sh: MINDSPORE_HCCL_CONFIG_PATH, RANK_SIZE and DEVICE_ID per process, no RANK_ID -- the
    rank is the table's entry for that device, as MindSpore took it."""
    from autopar.cluster.netutil import free_port

    table = tmp_path / "rank_table.json"
    devices = [{"devices": [{"device_id": str(d), "device_ip": f"192.1.27.{d + 6}"}], "rank_id": str(r),
                "server_id": "127.0.0.1"} for r, d in ((0, 1), (1, 0))]  # rank 0 drives device 1
    import json

    table.write_text(json.dumps({"board_id": "0x0000", "chip_info": "910", "deploy_mode": "lab", "group_count": "1",
                                 "group_list": [{"device_num": "2", "server_num": "1", "group_name": "",
                                                 "instance_count": "2", "instance_list": devices}],
                                 "status": "completed"}))
    port = str(free_port())
    ps = [procs.start([PYTHON, str(SCRIPTS / "job.py")],
                      procs.env(MINDSPORE_HCCL_CONFIG_PATH=str(table), RANK_SIZE="2", DEVICE_ID=str(d),
                                MASTER_PORT=port, JOB_STEPS="2"), log=tmp_path / f"device{d}.log") for d in (0, 1)]
    assert [p.wait(timeout=120) for p in ps] == [0, 0], [(tmp_path / f"device{d}.log").read_text() for d in (0, 1)]
    assert "RANK 1 OF 2" in (tmp_path / "device0.log").read_text()
    assert "RANK 0 OF 2" in (tmp_path / "device1.log").read_text()
