"""How much of a collective hides behind the compute beside it is the machine's, measured, not assumed: data
parallel's all-reduce and ZeRO's gathers are exposed by what does not hide; on one CPU host data parallel sums
through shared memory where that was calibrated."""
import dataclasses

import pytest
import torch

from autopar.models import mlp
from autopar.planner.machine import MachineModel
from autopar.planner.plan import plan_network


def _plan(machine):
    sample = (torch.randn(8, 1024), torch.randn(8, 1024))
    return plan_network(mlp(1024, 4), torch.nn.MSELoss(), sample, 2, machine)


def test_a_collective_hides_only_the_measured_share():
    whole = _plan(MachineModel(device_num=2, overlap=1.0))
    none = _plan(MachineModel(device_num=2, overlap=0.0))
    half = _plan(MachineModel(device_num=2, overlap=0.5))
    dp = [p.dp_totals for p in (whole, none, half)]
    assert dp[0].compute == dp[1].compute == dp[2].compute
    assert dp[0].comm < dp[2].comm < dp[1].comm
    assert dp[2].comm == pytest.approx((dp[0].comm + dp[1].comm) / 2)
    for level in ("level1", "level3"):
        assert whole.zero[level].comm < none.zero[level].comm
    assert MachineModel(device_num=2).hidden(3.0, 2.0) == 2.0  # not measured: all of it, as before


def test_data_parallel_on_one_host_sums_through_shared_memory_where_calibrated(monkeypatch):
    gloo = MachineModel(device_num=2, overlap=0.0)
    host = dataclasses.replace(gloo, collectives={**gloo.collectives, "host_all_reduce": (1e-5, 1e-11)})
    assert _plan(host).dp_totals.comm < _plan(gloo).dp_totals.comm
    monkeypatch.setenv("AUTOPAR_SHARED_MEMORY", "0")  # the reducer will not use it: nor does the plan
    assert _plan(host).dp_totals.comm == pytest.approx(_plan(gloo).dp_totals.comm)


def test_every_fsdp2_group_pays_its_own_collectives():
    """Four groups gather and reduce-scatter apart: four times a collective's fixed cost, not once."""
    from autopar.planner.plan import fsdp_groups

    net = mlp(1024, 4)
    assert fsdp_groups(net) == [4.0 * (1024 * 1024 + 1024)] * 4
    tied = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 10, bias=False))
    tied[1].weight = tied[0].weight  # one parameter, two holders: the network's own group
    assert fsdp_groups(tied) == [4.0 * 80]
    machine = MachineModel(device_num=2, overlap=0.0, collectives={k: (1e-3, 0.0) for k in
                                                                    MachineModel(device_num=2).collectives})
    zero = _plan(machine).zero
    assert zero["level1"].comm == pytest.approx(4 * 2e-3)  # alpha only: 4 gathers + 4 reduce-scatters
    assert zero["level3"].comm == pytest.approx(4 * 3e-3)
