"""``autopar launch --dry-run``: the user's unmodified script, simulated as rank r of N on this CPU, predicts what a
real run of it peaks at -- checked against the same script run for real on 2 and 4 gloo ranks, measured by the same
storage tracker (itself checked against torch's MemTracker in test_tracker.py) -- in every mode; a configuration
error stops it as one line before anything is launched; and a 6.6e9-parameter GPT on 1024 ranks is planned on this
machine."""
import json

import pytest

import autopar.dryrun.runner as runner_module
from autopar.dataset.synth import write_synthetic_cifar10
from procutil import ROOT, SCRIPTS, autopar_cmd

MODES = ["dp", "zero1", "zero2", "zero3", "semi_megatron", "semi_megatron_sp", "cp", "cp_ring", "ep", "pipeline",
         "pipeline_zero1", "pipeline_tp", "pipeline_cp", "pipeline_moe", "pipeline_ep", "auto"]
# The real runs: gradients reduced through the process group (the CPU-only shared-memory reducer is not what a
# cluster runs), AUTO decided by its prediction alone (a measured round picks by timing, which varies run to run)
ENV = {"AUTOPAR_SHARED_MEMORY": "0", "AUTOPAR_AUTO_TRIALS": "0", "AUTOPAR_MEASURE_OPS": "0"}
# Megatron strategies on 4 ranks: heads of 32 features and more stop at the attention's ``.contiguous().view()``
# (a DTensor whose local strides are not its wrapper's; the real run and the dry run stop alike): a narrower GPT
SIZES = {("semi_megatron", 4): ("2", "32", "512", "64", "4"), ("semi_megatron_sp", 4): ("2", "32", "512", "64", "4")}
# the suite's minutes: each mode once, on 2 ranks where the world size changes nothing of it, on 4 where a two-axis
# mesh or a split of four does (ZeRO-3's shards, the tensor and sequence splits, the pipeline's data-parallel
# replicas, AUTO's search); the tensor split on both. Every mode was within the 10 % on both world sizes while this test
# ran them all (until 2026-11-27).
# (the ring: 2 ranks pass its blocks round as 4 do; the experts' all-to-all: 2 ranks exchange tokens as 4 do)
ON_2 = {"dp", "zero1", "zero2", "semi_megatron", "cp_ring", "ep", "pipeline_moe"}
SKIP = {(m, 2) for m in MODES if m not in ON_2} | {(m, 4) for m in ON_2 - {"semi_megatron"}}
# and on 8 ranks, where a stage's 4 replicas hold each expert twice (groups of 2) and ZeRO shards those copies
CASES = [(m, n) for n in (2, 4) for m in MODES if (m, n) not in SKIP] + [("pipeline_ep_zero", 8)]


def _dry(procs, tmp_path, n, *script_args, ok=True, script=str(SCRIPTS / "dryrun_gpt.py")):
    logs = tmp_path / f"dry{n}_{'_'.join(script_args)}"
    res = procs.run(autopar_cmd("launch", "--dry-run", "-n", str(n), "--log-dir", str(logs), script, *script_args),
                    env=procs.env(**ENV), timeout=300)
    if ok:
        assert res.returncode == 0, res.stdout + res.stderr
    return res, (json.loads((logs / "dryrun.json").read_text()) if (logs / "dryrun.json").exists() else None)


@pytest.mark.parametrize("mode,n", CASES, ids=[f"{m}-{n}" for m, n in CASES])
def test_a_dry_run_predicts_the_peak_of_a_real_run_in_every_mode(procs, tmp_path, mode, n):
    table, bad = [], []
    out = tmp_path / f"real_{mode}"
    res = procs.run(autopar_cmd("launch", "-n", str(n), "--log-dir", str(tmp_path / f"logs_{mode}"),
                                runner_module.__file__, "--measure", "--out", str(out),
                                str(SCRIPTS / "dryrun_gpt.py"), mode, *SIZES.get((mode, n), ())),
                    env=procs.env(**ENV), timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    real = json.loads(open(f"{out}.0").read())
    _, report = _dry(procs, tmp_path, n, mode, *SIZES.get((mode, n), ()))
    dry = report["ranks"]["0"]
    assert dry["error"] is None and real["error"] is None, (mode, dry["error"], real["error"])
    for what in ("peak", "step"):
        got, want = (dry, real) if what == "peak" else (dry["steady"], real["steady"])
        ratio = got["peak_bytes"] / want["peak_bytes"]
        table.append(f"{mode:>14} {what}: predicted {got['peak_bytes']} measured {want['peak_bytes']} {ratio:.3f}")
        if not 0.9 <= ratio <= 1.1:
            bad.append(table[-1])
        # the parts add up to the peak
        assert sum(got[k] for k in ("parameters", "gradients", "optimizer", "activations", "other")) == \
            got["peak_bytes"], (mode, got)
    if mode.startswith("pipeline"):  # one simulated rank per stage: rank 0 and the first of stage 1
        assert sorted(report["ranks"]) == ["0", str(n // 2)], report["ranks"].keys()
    if mode == "pipeline_ep":  # the experts' exchange followed on balanced routing, nothing left out
        assert not any("expert parallelism" in w for w in dry["warnings"]), dry["warnings"]
    if mode == "auto":
        assert report["predicted_step_s"] and report["predicted_step_s"] > 0
    print("\n".join(table))
    assert not bad, "\n".join(table)


def test_a_gpt_written_from_scratch_is_predicted_within_10_percent_of_torchs_memtracker(procs, tmp_path):
    """Issue 55: a GPT script the suite did not write for the dry run (SDPA; qkv and fc split by columns, proj and out
    by rows with ``autopar.shard`` tuples; an untied head; AdamW; 2 ranks) -- its real run measured by torch's own
    MemTracker, not the dry run's tracker -- was reported 20 % under in SEMI_AUTO. Predicted and measured agree."""
    import re

    script = str(SCRIPTS / "dryrun_scratch_gpt.py")
    res = procs.run(autopar_cmd("launch", "-n", "2", "--log-dir", str(tmp_path / "real"), script, "mt"),
                    env=procs.env(**ENV), timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    measured = int(re.search(r"\[rank 0\] MemTracker peak (\d+)", res.stdout).group(1))
    _, report = _dry(procs, tmp_path, 2, script=script)
    predicted = report["ranks"]["0"]["peak_bytes"]
    assert 0.9 <= predicted / measured <= 1.1, (predicted, measured)


def test_a_configuration_error_is_one_line_and_nothing_is_launched(procs, tmp_path):
    for mode, line in (("pipeline", "ConfigError: pipeline_stages=2 does not divide the 3 ranks (at dryrun_gpt.py:"),
                       ("semi_megatron", "cannot be split into 3 parts")):
        res, report = _dry(procs, tmp_path, 3, mode, ok=False)
        assert res.returncode == 1, res.stdout + res.stderr
        errors = [e for e in res.stderr.splitlines() if e.startswith("autopar: error:")]
        assert len(errors) == 1 and "dry run, rank 0 of 3" in errors[0] and line in errors[0], res.stderr
        assert "Traceback" not in res.stderr and report["ranks"]["0"]["error"]
        assert not list((tmp_path / f"dry3_{mode}").glob("scheduler*.log"))  # no job was started
    res = procs.run(autopar_cmd("launch", "--dry-run", "-n", "4", "--dry-run-ranks", "1,9",
                                str(SCRIPTS / "dryrun_gpt.py"), "dp"), timeout=60)
    assert res.returncode != 0 and "rank 9 is not in 0..3" in res.stderr, res.stderr
    res = procs.run(autopar_cmd("launch", "--dry-run", "-n", "4", "--dry-run-machine", "nope",
                                str(SCRIPTS / "dryrun_gpt.py"), "auto"), timeout=60)
    assert res.returncode != 0 and "unknown machine 'nope'" in res.stderr and "Traceback" not in res.stderr


def test_auto_plans_for_the_cluster_it_is_told(procs, tmp_path):
    logs = tmp_path / "logs"
    res = procs.run(autopar_cmd("launch", "--dry-run", "-n", "8", "--dry-run-machine", "h100-ib", "--log-dir",
                                str(logs), str(SCRIPTS / "dryrun_gpt.py"), "auto"), timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "AUTO_PARALLEL's plan:" in res.stdout and "on h100-ib)" in res.stdout, res.stdout
    assert json.loads((logs / "dryrun.json").read_text())["predicted_step_s"] > 0


def test_a_6_6b_gpt_on_1024_ranks_fits_with_zero3_and_not_with_data_parallel(procs, tmp_path):
    """GPT, 32 layers, hidden 4096, vocabulary 32000, sequence 2048 (6.6e9 parameters), one sequence per rank."""
    big = ("32", "4096", "32000", "2048", "1")
    # the two dry runs side by side (one simulated rank each: one core each)
    jobs = {}
    for mode in ("zero3", "dp"):  # two steps: the second is the steady one (the optimizer state made)
        logs = tmp_path / f"dry1024_{mode}"
        jobs[mode] = (logs, procs.start(autopar_cmd("launch", "--dry-run", "-n", "1024", "--log-dir", str(logs),
                                                    str(SCRIPTS / "dryrun_gpt.py"), mode, *big),
                                        env=procs.env(DRYRUN_GPT_STEPS="2", **ENV),
                                        log=tmp_path / f"dry1024_{mode}.out"))
    reports = {}
    for mode, (logs, popen) in jobs.items():
        assert popen.wait(timeout=300) == 0, (tmp_path / f"dry1024_{mode}.out").read_text()
        reports[mode] = json.loads((logs / "dryrun.json").read_text())
    z, d = (reports[m]["ranks"]["0"]["steady"] for m in ("zero3", "dp"))
    params = 4 * 6.6e9
    assert d["parameters"] == pytest.approx(params, rel=0.02) and d["optimizer"] == pytest.approx(2 * params, rel=0.02)
    assert z["parameters"] == pytest.approx(params / 1024, rel=0.05)
    assert z["optimizer"] == pytest.approx(2 * params / 1024, rel=0.05)
    state = ("parameters", "gradients", "optimizer")
    assert sum(d[k] for k in state) > 80 * sum(z[k] for k in state)  # ZeRO-3's gradients hold one layer unsharded
    assert d["peak_bytes"] > 100e9 > 25e9 > z["peak_bytes"]


def test_the_mindspore_tutorial_script_dry_runs_as_it_runs(procs, tmp_path):
    """The MindSpore door: the CPU tutorial's resnet50_distributed_training.py (imports swapped; Model.train, the
    CIFAR-10 reader sharded per rank, Momentum), unmodified, simulated and run for real on 2 ranks."""
    data = write_synthetic_cifar10(tmp_path / "cifar", records_per_file=256)
    script = str(ROOT / "examples" / "resnet50_distributed_training.py")
    env = procs.env(IMAGE_SIZE="32", BATCH_SIZE="16", EPOCH_SIZE="1", DATA_PATH=str(data), **ENV)
    res = procs.run(autopar_cmd("launch", "-n", "2", "--log-dir", str(tmp_path / "logs"), runner_module.__file__,
                                "--measure", "--steps", "2", "--out", str(tmp_path / "real"), script), env=env,
                    timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    real = json.loads((tmp_path / "real.0").read_text())
    res = procs.run(autopar_cmd("launch", "--dry-run", "-n", "2", "--log-dir", str(tmp_path / "dry"), script),
                    env=env, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    dry = json.loads((tmp_path / "dry" / "dryrun.json").read_text())["ranks"]["0"]
    assert real["steps"] == dry["steps"] == 2
    for part in ("parameters", "optimizer"):
        assert dry["steady"][part] == real["steady"][part]
    assert 0.9 <= dry["steady"]["peak_bytes"] / real["steady"]["peak_bytes"] <= 1.1, (dry, real)


def test_a_torchrun_script_dry_runs_as_it_runs(procs, tmp_path):
    """The PyTorch door without autopar in the script: a torchrun-style GPT in torch's DDP (the dry run's stand-in:
    its gradient buckets and all-reduces, since DDP's C++ side reads values) and in FSDP2 built on the meta device
    (``fully_shard``, ``to_empty``, ``reset_parameters``), dry-run and measured for real on 2 gloo ranks."""
    for how in ("ddp", "fsdp"):
        script = str(SCRIPTS / "torchrun_gpu.py")
        res = procs.run(autopar_cmd("launch", "-n", "2", "--log-dir", str(tmp_path / f"real_{how}"),
                                    runner_module.__file__, "--measure", "--out", str(tmp_path / how), script, how),
                        env=procs.env(**ENV), timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr
        real = json.loads((tmp_path / f"{how}.0").read_text())
        _, report = _dry(procs, tmp_path, 2, how, script=script)
        dry = report["ranks"]["0"]
        assert dry["error"] is None and real["error"] is None, (how, dry["error"], real["error"])
        for part in ("parameters", "optimizer"):
            assert dry["steady"][part] == real["steady"][part], (how, part, dry["steady"], real["steady"])
        ratio = dry["steady"]["peak_bytes"] / real["steady"]["peak_bytes"]
        assert 0.9 <= ratio <= 1.1, (how, dry["steady"], real["steady"])


READS_A_VALUE = """import torch
import autopar

autopar.init()
autopar.set_auto_parallel_context(parallel_mode="data_parallel", gradients_mean=True)
net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(net.parameters(), lr=0.05)
for step in range(5):
    x = torch.randn(16, 8)
    loss = torch.nn.functional.mse_loss(net(x), x.sum(1, keepdim=True))
    opt.zero_grad(); loss.backward()

    if loss.item() > 1e6:
        break
    opt.step()
"""


def test_a_value_read_from_a_fake_tensor_is_named_by_the_users_line(procs, tmp_path):
    """The script's ``loss.item()`` (line 13) is the line named -- not line 10, where the network's first call made
    autopar read values of its own -- and the table's rows say what they are."""
    script = tmp_path / "reads.py"
    script.write_text(READS_A_VALUE)
    res = procs.run(autopar_cmd("launch", "--dry-run", "-n", "2", "--log-dir", str(tmp_path / "dry"), str(script)),
                    timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "values the script read from fake tensors (line 13: loss.item() and the like)" in res.stdout, res.stdout
    rows = [line.split()[:3] for line in res.stdout.splitlines() if line.startswith("0 ")]
    assert rows == [["0", "whole", "run"], ["0", "training", "step"]], res.stdout
