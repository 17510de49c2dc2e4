"""The dry run's storage tracker counts what torch's own MemTracker counts (one process, real tensors, a loop MemTracker
accepts), and keeps counting where MemTracker refuses: a module called twice in one iteration."""
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from autopar.dryrun.tracker import StorageTracker


def _job():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    return net, torch.optim.AdamW(net.parameters(), lr=1e-3)


def _steps(net, opt, k, after=None, twice=False):
    for _ in range(k):
        x = torch.randn(64, 256)
        y = net(net(x)) if twice else net(x)
        y.square().mean().backward()
        opt.step()
        opt.zero_grad()
        if after is not None:
            after()


def test_the_tracker_counts_what_memtracker_counts():
    net, opt = _job()
    mt = MemTracker()
    mt.track_external(net, opt)
    with mt:
        _steps(net, opt, 2, mt.reset_mod_stats)
    theirs = {str(k).split(".")[-1]: v for k, v in mt.get_tracker_snapshot("peak")[torch.device("cpu")].items()}
    with StorageTracker() as tracker:
        net, opt = _job()
        _steps(net, opt, 2)
    mine = tracker.report()
    assert mine["peak_bytes"] == theirs["Total"]
    assert (mine["parameters"], mine["gradients"], mine["optimizer"]) == (theirs["PARAM"], theirs["GRAD"], theirs["OPT"])
    assert mine["steps"] == 2 and mine["steady"]["peak_bytes"] == mine["peak_bytes"]


def test_the_tracker_counts_a_module_called_twice_and_frees_what_is_gone():
    with StorageTracker() as tracker:
        net, opt = _job()
        _steps(net, opt, 2, twice=True)
        before = tracker.current
        del net, opt
    assert tracker.report()["activations"] > 0
    assert tracker.current < before  # the parameters, gradients and optimizer state went with their last reference


def test_the_tracker_leaves_torch_as_it_found_it():
    resize = torch.UntypedStorage.resize_
    with StorageTracker():
        assert torch.UntypedStorage.resize_ is not resize
    assert torch.UntypedStorage.resize_ is resize


def test_autopar_side_work_is_neither_a_step_nor_memory_of_the_training():
    """A calibration or the planner's measurements step optimizers and allocate large buffers of their own before
    training starts (a cold cache in a real AUTO run): the tracker counted their steps -- the measured run stopped
    inside the calibration after two -- and their 64 MB buffers as the run's peak."""
    from autopar.context import side_work

    with StorageTracker() as tracker:
        with side_work():
            probe = torch.nn.Parameter(torch.zeros(4 << 20))  # 16 MiB, as the calibration's optimizer probe
            probe.grad = torch.ones_like(probe)
            side = torch.optim.SGD([probe], lr=1e-9, momentum=0.9)
            side.step()
            side.step()
            del probe, side
        net, opt = _job()
        _steps(net, opt, 2)
    report = tracker.report()
    with StorageTracker() as plain:
        net, opt = _job()
        _steps(net, opt, 2)
    assert report["steps"] == 2 and report["steady"]["peak_bytes"] == report["peak_bytes"]
    assert report["peak_bytes"] == plain.report()["peak_bytes"] < 48 << 20  # the network's, not the side work's
