"""AUTO_PARALLEL: the planner's choices on fixed machine constants (deterministic), and a real job that plans with
a calibrated machine, trains, and equals the unsharded network."""
import dataclasses
import json
import re

import pytest
import torch

from autopar.cli.main import main as cli
from autopar.errors import StrategyError
from autopar.models import mlp, resnet50
from autopar.nn import SoftmaxCrossEntropyExpand
from autopar.ops.shard import shard
from autopar.planner.machine import MachineModel
from autopar.planner.plan import plan_network
from procutil import SCRIPTS, autopar_cmd


def plan_resnet(n, mode="dynamic_programming"):
    b = 32 * n  # the tutorial's 32 images per device
    sample = (torch.randn(b, 3, 32, 32), torch.randint(0, 10, (b,), dtype=torch.int32))
    return plan_network(resnet50(num_classes=10), SoftmaxCrossEntropyExpand(sparse=True), sample, n,
                        MachineModel(device_num=n), mode)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_resnet50_plan_is_pure_data_parallel(n):
    plan = plan_resnet(n)
    assert plan.pure_data_parallel, plan.explain()
    assert len(plan.graph.nodes) == 54  # 53 convolutions + the dense layer
    assert plan.search_seconds < 2.0
    assert "data parallel" in plan.reason


def test_wide_mlp_with_small_batch_shards_the_weights():
    plan = plan_network(mlp(4096, 4), torch.nn.MSELoss(), (torch.randn(8, 4096), torch.randn(8, 4096)), 2,
                        MachineModel(device_num=2))
    assert not plan.pure_data_parallel
    labels = [plan.chosen(i).label for i in range(4)]
    assert labels == ["out 2", "contract 2", "out 2", "contract 2"], labels  # Megatron column / row, found
    assert plan.totals.step < plan.dp_totals.step
    assert plan.totals.memory < plan.dp_totals.memory / 1.9
    text = plan.explain()
    assert "data parallel: step" in text and "chosen: the searched plan" in text and "contract 2" in text


def test_layouts_pay_for_summing_the_gradients_of_parameters_outside_the_operators():
    """A layout leaves the norms' weights replicated: DTensor sums each one's partial gradient alone (no bucket)."""
    from autopar.models import TransformerBlock

    block = TransformerBlock(64, 4, 128)
    for name in ("q", "k", "v", "ff1"):
        shard(getattr(block, name), ((1, 1, 1), (2, 1)))
    for name in ("proj", "ff2"):
        shard(getattr(block, name), ((1, 1, 2), (1, 2)))
    machine = MachineModel(device_num=2)
    plan = plan_network(block, torch.nn.MSELoss(), (torch.randn(4, 16, 64), torch.randn(4, 16, 64)), 2, machine,
                        "sharding_propagation")
    norms = [p for n, p in block.named_parameters() if n.startswith("ln")]
    assert len(norms) == 4  # two LayerNorms' weights and biases
    sums = sum(machine.collective("all_reduce", p.numel() * 4, 2) for p in norms)
    assert plan.problem.other_sums == pytest.approx(sums) and sums > 0
    assert plan.totals.comm >= sums
    assert "the gradients of the parameters outside the operators, summed one at a time" in plan.explain()
    # a network whose every parameter belongs to an operator pays none
    wide = plan_network(mlp(256, 2), torch.nn.MSELoss(), (torch.randn(8, 256), torch.randn(8, 256)), 2,
                        MachineModel(device_num=2))
    assert wide.problem.other_sums == 0.0 and "outside the operators" not in wide.explain()


def test_memory_limit_forces_sharding_and_an_infeasible_one_is_a_clear_error():
    sample = (torch.randn(256, 1024), torch.randn(256, 1024))
    free = plan_network(mlp(1024, 4), torch.nn.MSELoss(), sample, 2, MachineModel(device_num=2))
    limited = plan_network(mlp(1024, 4), torch.nn.MSELoss(), sample, 2, MachineModel(device_num=2),
                           memory_limit=free.dp_totals.memory * 0.7)
    assert free.pure_data_parallel and free.zero_level is None  # DDP where data parallel fits
    assert limited.zero_level or not limited.pure_data_parallel  # ZeRO or a layout: whichever is predicted faster
    assert limited.totals.memory <= free.dp_totals.memory * 0.7
    with pytest.raises(StrategyError, match=r"no plan fits the memory limit of 1.0 MiB per device on 2 devices; "
                                            r"the smallest plan found needs [\d.]+ MiB"):
        plan_network(mlp(1024, 4), torch.nn.MSELoss(), sample, 2, MachineModel(device_num=2), memory_limit=2**20)


def test_data_parallel_that_does_not_fit_gets_zero_when_no_layout_fits():
    """Large batch, small weights: the activations dominate and no layout of the operators beats data parallel's
    memory; sharding the optimizer state, gradients and weights (ZeRO level 3) is the one plan that fits."""
    net = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(256, 256), torch.nn.ReLU())][:-1])
    sample = (torch.randn(4096, 256), torch.randn(4096, 256))
    plan = plan_network(net, torch.nn.MSELoss(), sample, 2, MachineModel(device_num=2), memory_limit=18.3 * 2**20)
    assert plan.pure_data_parallel and plan.zero_level == "level3", plan.explain()
    assert plan.totals.memory <= 18.3 * 2**20 < plan.dp_totals.memory
    text = plan.explain()
    assert "data parallel + ZeRO level1 (optimizer state sharded over 2)" in text
    assert "chosen: data parallel + ZeRO level3" in text and "no layout of the operators fits" in text
    # a decision kept by a run without the limit (data parallel) is not re-used under it: the limit as asked is
    # checked, not the unlimited problem ZeRO's path searched
    from autopar.parallel.trials import _still_fits
    from autopar.planner.alternatives import as_choice
    from autopar.planner.plan import Totals

    kept = dataclasses.replace(plan, choice=plan.problem.dp_choice(), zero_level=None, totals=plan.dp_totals,
                               reason="data parallel")
    assert plan.problem.memory_limit is None and not _still_fits(plan, {"choice": list(as_choice(kept))})
    assert _still_fits(plan, {"choice": list(as_choice(plan))}) and isinstance(plan.totals, Totals)
    tighter = plan_network(net, torch.nn.MSELoss(), sample, 2, MachineModel(device_num=2), memory_limit=17 * 2**20)
    assert tighter.pipeline is not None and tighter.pipeline.memory <= 17 * 2**20, tighter.explain()  # only a pipeline
    with pytest.raises(StrategyError, match=r"data parallel with ZeRO level3 needs 18\.0 MiB; a pipeline of 2 stages "
                                            r"needs \d+\.\d MiB"):
        plan_network(net, torch.nn.MSELoss(), sample, 2, MachineModel(device_num=2), memory_limit=2**20)


def test_pipelines_are_weighed_balanced_and_explained():
    """A chain of cells can be cut: each stage count's best micro-batch count, balanced stages, the bubble in the
    table; chosen when nothing else fits. A forward that is not a chain of cells, or a loop that runs its own
    backward, says why no pipeline was weighed."""
    net = torch.nn.Sequential(*[m for _ in range(8) for m in (torch.nn.Linear(256, 256), torch.nn.ReLU())][:-1])
    sample = (torch.randn(2048, 256), torch.randn(2048, 256))
    free = plan_network(net, torch.nn.MSELoss(), sample, 4, MachineModel(device_num=4))
    assert free.pure_data_parallel and free.pipeline is None, free.explain()
    assert [(o.stages, o.replicas) for o in free.pipelines] == [(2, 2), (4, 1)]
    two, four = free.pipelines
    assert two.split_points == ["8"] and four.split_points == ["4", "8", "12"]  # 2 linear layers per stage of 4
    assert two.bubble == pytest.approx(1 / (two.micro_batches + 1)) and two.micro_batches >= 2
    assert two.memory < free.dp_totals.memory / 2
    limited = plan_network(net, torch.nn.MSELoss(), sample, 4, MachineModel(device_num=4), memory_limit=6 * 2**20)
    assert limited.pipeline is not None and limited.pipeline.memory <= 6 * 2**20, limited.explain()
    text = limited.explain()
    assert "chosen: pipeline " in text and "bubble" in text and "micro-batches of" in text and "split before" in text
    loop = plan_network(net, None, sample[:1], 4, MachineModel(device_num=4), pipeline_note="the loop runs its backward")
    assert not loop.pipelines and "pipeline: not weighed -- the loop runs its backward" in loop.explain()

    class Residual(torch.nn.Module):  # the same cell before and after another: not a chain
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

        def forward(self, x):
            return self.a(self.b(self.a(x)))

    odd = plan_network(Residual(), torch.nn.MSELoss(), (torch.randn(32, 64), torch.randn(32, 64)), 2,
                       MachineModel(device_num=2))
    assert not odd.pipelines and "cell 'a' runs twice" in odd.explain()


def test_search_modes_and_user_strategies():
    sample = (torch.randn(8, 4096), torch.randn(8, 4096))
    greedy = plan_network(mlp(4096, 4), torch.nn.MSELoss(), sample, 2, MachineModel(device_num=2),
                          "recursive_programming")
    exact = plan_network(mlp(4096, 4), torch.nn.MSELoss(), sample, 2, MachineModel(device_num=2))
    assert greedy.totals.step >= exact.totals.step - 1e-9  # the exact optimum is never beaten
    assert greedy.totals.step < greedy.dp_totals.step
    net = mlp(4096, 4)
    shard(net[0], ((1, 1), (2, 1)))  # the user fixes the first layer: column split
    propagated = plan_network(net, torch.nn.MSELoss(), sample, 2, MachineModel(device_num=2), "sharding_propagation")
    assert propagated.chosen(0).strategy[:2] == ((1, 1), (2, 1))
    assert propagated.chosen(1).label == "contract 2"  # its neighbour follows: a row split reshards nothing
    assert "kept as given" in propagated.reason


def test_plan_cli_prints_the_table_and_writes_a_strategy_file(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert cli(["plan", "mlp", "-n", "2", "--batch", "4", "--width", "1024", "--no-calibrate", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "operator" in text and "plan total: step" in text and "data parallel: step" in text
    params = json.loads(out.read_text())["parameters"]
    assert params["0.weight"]["tensor_map"] == [1, -1] and params["2.weight"]["tensor_map"] == [-1, 1]


def test_auto_parallel_job_calibrates_plans_and_trains_like_one_process(procs, tmp_path):
    env = procs.env(AUTOPAR_CACHE_DIR=str(tmp_path / "cache"))
    res = procs.run(autopar_cmd("launch", "-n", "2", "--log-dir", str(tmp_path / "logs"),
                                str(SCRIPTS / "auto_train.py"), str(tmp_path / "out")), env, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    log = (tmp_path / "logs" / "worker_0.log").read_text()
    # the searched layouts, or -- where this noisy machine's calibration predicts it >= 25 % faster -- a pipeline of
    # the 4 layers (seen once in ~10 runs: 8.7 vs 13.4 ms); either way data parallelism does not fit
    # (the measured round may keep a runner-up of the searched layouts: "layouts: ..., measured fastest ...")
    piped = "AUTO_PARALLEL: pipeline 2 stages" in log  # (its reason may end "measured fastest of 2" too)
    searched = not piped and ("AUTO_PARALLEL: the searched plan" in log or "measured fastest" in log)
    assert searched or piped, log
    assert "data parallel does not fit in memory" in log, log
    cache = list((tmp_path / "cache").glob("machine-gloo-n2-*.json"))
    assert len(cache) == 1
    calibrated = json.loads(cache[0].read_text())
    assert calibrated["source"].startswith("calibrated") and calibrated["collectives"]["all_reduce"][1] > 0
    for rank in range(2):
        r = json.load(open(tmp_path / f"out.{rank}"))
        assert r["diff"] <= 1e-5 and (r["sharded"] or not searched), r
        assert r["local_params"] < r["full_params"] * 0.75 or not searched  # (a pipeline's stages are re-gathered)
    assert "AUTO_PARALLEL plan on 2 devices" in (tmp_path / "logs" / "auto_parallel_plan.txt").read_text()
    # DTensor's redistributions between the operators and the optimizer step on the network's own parameters were
    # measured in the job, as it runs them, and kept beside the operators
    kept = json.loads(next((tmp_path / "cache").glob("ops-*-n2-*.json")).read_text())
    reshards = {k: v for k, v in kept.items() if k.startswith("('reshard'")}
    assert reshards and all(0 < fwd <= total for fwd, total in reshards.values()), kept.keys()
    rates = [v for k, v in kept.items() if k.startswith("('optimizer and scale'")]
    # (SGD fused on plain tensors, on DTensor slices, and gradients_mean's scale of a layout's gradients)
    assert len(rates) == 1 and len(rates[0]) == 3 and min(rates[0]) > 0, kept.keys()
    strategy = json.loads((tmp_path / "out.strategy.json").read_text())["parameters"]
    assert any(-1 != a for e in strategy.values() for a in e["tensor_map"]) or not searched


def test_auto_parallel_job_that_only_fits_with_zero_trains_like_one_process(procs, tmp_path):
    res = procs.run(autopar_cmd("launch", "-n", "2", "--log-dir", str(tmp_path / "logs"),
                                str(SCRIPTS / "auto_train.py"), str(tmp_path / "out"), "zero"),
                    procs.env(AUTOPAR_CACHE_DIR=str(tmp_path / "cache")), timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    log = (tmp_path / "logs" / "worker_0.log").read_text()
    assert "AUTO_PARALLEL: data parallel + ZeRO level3" in log, log
    # planning time said, the measuring of the costs included (ZeRO stepped whole here: seconds, not nothing)
    costs = re.search(r"AUTO_PARALLEL: .*\(capture [0-9.]+ s, costs ([0-9.]+) s, search [0-9.]+ s", log)
    assert costs and float(costs.group(1)) > 0, log
    for rank in range(2):
        r = json.load(open(tmp_path / f"out.{rank}"))
        assert r["diff"] <= 1e-5 and r["sharded"], r  # FSDP2 holds each weight as a Shard(0) DTensor
        assert r["local_params"] * 2 == r["full_params"]
    assert "ZeRO level3 (optimizer state, gradients and weights sharded over 2)" in (
        tmp_path / "logs" / "auto_parallel_plan.txt").read_text()
    # data parallel does not fit, so ZeRO could be chosen: its step was measured whole on this job's devices (the
    # network sharded as ZeRO shards it, both levels), and the data-parallel step whole
    kept = json.loads(next((tmp_path / "cache").glob("ops-*-n2-*.json")).read_text())
    zero = {k: v for k, v in kept.items() if k.startswith("zero step ")}
    assert len(zero) == 1 and all(len(v) == 2 and min(v) > 0 for v in zero.values()), kept.keys()
    assert any(k.startswith("step ") for k in kept)


def test_auto_parallel_job_that_only_fits_as_a_pipeline_trains_like_one_process(procs, tmp_path):
    """4 ranks, a limit only a pipeline meets: AUTO cuts the network into stages (the table shows stages,
    micro-batches and the bubble), Model.train runs it on the ranks' data-parallel shards, the result equals one
    process and every rank ends with the whole trained network (Model.eval agrees)."""
    res = procs.run(autopar_cmd("launch", "-n", "4", "--log-dir", str(tmp_path / "logs"),
                                str(SCRIPTS / "auto_train.py"), str(tmp_path / "out"), "pipeline"),
                    procs.env(AUTOPAR_CACHE_DIR=str(tmp_path / "cache")), timeout=400)
    assert res.returncode == 0, res.stdout + res.stderr + (tmp_path / "logs" / "worker_0.log").read_text()
    log = (tmp_path / "logs" / "worker_0.log").read_text()
    assert "AUTO_PARALLEL: pipeline " in log and "no layout of the operators fits" in log, log
    table = (tmp_path / "logs" / "auto_parallel_plan.txt").read_text()
    assert "pipeline 2 stages x 2 replicas" in table and "pipeline 4 stages x 1 replica" in table, table
    assert "micro-batches of" in table and "bubble" in table and "split before" in table, table
    for rank in range(4):
        r = json.load(open(tmp_path / f"out.{rank}"))
        assert r["diff"] <= 1e-5 and r["eval_diff"] <= 1e-5, r


def test_measured_round_keeps_the_fastest_plan_leaves_training_exact_and_is_not_repeated(procs, tmp_path):
    """A plain loop in AUTO_PARALLEL: the runners-up (data parallel and the next-best layouts) run a few steps each
    on copies; the table lists each plan's predicted and measured step and the one kept; training equals one
    process. A restart with the same cache reads the decision instead of measuring."""
    # (every runner-up measured: predicted 3.07x data parallel on a loaded host, the layouts were left out, and no
    # round ran at all)
    env = procs.env(AUTOPAR_CACHE_DIR=str(tmp_path / "cache"), AUTOPAR_AUTO_TRIAL_STEPS="1",
                    AUTOPAR_AUTO_TRIALS_WITHIN="20")
    for run in ("first", "again"):
        logs = tmp_path / run
        res = procs.run(autopar_cmd("launch", "-n", "2", "--log-dir", str(logs), str(SCRIPTS / "auto_trials.py"),
                                    str(tmp_path / run)), env, timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr + (logs / "worker_0.log").read_text()
        table = (logs / "auto_parallel_plan.txt").read_text()
        assert "measured round" in table and "data parallel" in table, table
        rows = [line for line in table.splitlines() if "predicted" in line and "measured" in line and "ms" in line]
        assert len(rows) >= 2, table
        trained = [line for line in table.splitlines() if line.startswith("in training: ")]
        assert len(trained) == 1 and "predicted" in trained[0] and "median of 5" in trained[0], table
        if run == "first":  # the seconds spent measuring costs and the round, said whichever plan the round kept
            log = (logs / "worker_0.log").read_text()
            said = re.search(r"AUTO_PARALLEL: .*\(capture [0-9.]+ s, costs ([0-9.]+) s, search [0-9.]+ s, "
                             r"measured round ([0-9.]+) s over", log)
            assert said and float(said.group(1)) > 0, log
            # data parallel's step measured whole -- the runtime's reducer on a copy -- and kept with the operators
            dp_line = next(line for line in table.splitlines() if line.startswith("data parallel: step"))
            assert dp_line.endswith("(the step measured whole: the runtime's data parallel on a copy)"), table
            kept = json.loads(next((tmp_path / "cache").glob("ops-*-n2-*.json")).read_text())
            whole = {k: v for k, v in kept.items() if k.startswith("data-parallel step ")}
            copy_key = next(k for k in whole if not k.endswith(" measured round"))
            assert len(whole[copy_key]) == 2 and min(whole[copy_key]) > 0, kept.keys()
            # and beside it data parallel's step as the round timed it, which later plans predict with
            dp_row = next(line for line in rows if line.strip().startswith("data parallel ") and "ZeRO" not in line)
            assert "failed" not in dp_row, table
            round_dp = float(re.search(r"measured +([0-9.]+) ms", dp_row).group(1))
            assert whole[copy_key + " measured round"] == pytest.approx([round_dp / 1e3] * 2, abs=1e-4), whole
        else:  # the restart predicts data parallel with the faster of the copy's step and the first run's round's
            dp_line = next(line for line in table.splitlines() if line.startswith("data parallel: step"))
            by_round = whole[copy_key + " measured round"][0] <= whole[copy_key][0]
            how = "as a measured round ran it" if by_round else "on a copy"
            assert dp_line.endswith(f"(the step measured whole: the runtime's data parallel {how})"), table
            step = float(re.search(r"step ([0-9.]+) ms", dp_line).group(1))
            expected = 1e3 * min(whole[copy_key][0], whole[copy_key + " measured round"][0])
            assert step == pytest.approx(expected, abs=0.11), (step, whole)
            kept_first = table.split("measured round (")[1].splitlines()[1].strip()
            if kept_first.startswith("data parallel "):  # the plan read back is data parallel: predicted so too
                total = next(line for line in table.splitlines() if line.startswith("plan total: step"))
                assert float(re.search(r"step ([0-9.]+) ms", total).group(1)) == step, table
        for rank in range(2):
            r = json.load(open(tmp_path / f"{run}.{rank}"))
            assert r["diff"] <= 1e-5, r
    assert "decision read from" in table and "measured round" not in (tmp_path / "again" / "worker_0.log").read_text()
    assert len(list((tmp_path / "cache").glob("plan-gloo-n2-*.json"))) == 1
