"""Context values of the wrong type or inconsistent with the job, each set where a tutorial sets it: before init()."""
from sweep_core import Verdict, case

# (name, the calls after ``import autopar as ms``): every one must end in one clear line, exit != 0
BAD = [
    ("mode=5", "ms.set_context(mode=5)"),
    ("device_target=Ascend", "ms.set_context(device_target='Ascend')"),
    ("device_target=TPU", "ms.set_context(device_target='TPU')"),
    ("device_id='x'", "ms.set_context(device_id='x')"),
    ("max_device_memory='lots'", "ms.set_context(max_device_memory='lots')"),
    ("set_context unknown key", "ms.set_context(bogus=1)"),
    ("parallel_mode='foo'", "ms.set_auto_parallel_context(parallel_mode='foo')"),
    ("gradients_mean='no'", "ms.set_auto_parallel_context(gradients_mean='no')"),
    ("gradients_mean=1", "ms.set_auto_parallel_context(gradients_mean=1)"),
    ("enable_parallel_optimizer='False'", "ms.set_auto_parallel_context(enable_parallel_optimizer='False')"),
    ("parameter_broadcast='yes'", "ms.set_auto_parallel_context(parameter_broadcast='yes')"),
    ("full_batch='True'", "ms.set_auto_parallel_context(full_batch='True')"),
    ("device_num=True", "ms.set_auto_parallel_context(device_num=True)"),
    ("device_num=0", "ms.set_auto_parallel_context(device_num=0)"),
    ("device_num='2'", "ms.set_auto_parallel_context(device_num='2')"),
    ("global_rank=-1", "ms.set_auto_parallel_context(global_rank=-1)"),
    ("search_mode='fast'", "ms.set_auto_parallel_context(search_mode='fast')"),
    ("grad_accumulation_step=0", "ms.set_auto_parallel_context(grad_accumulation_step=0)"),
    ("pipeline_stages=0", "ms.set_auto_parallel_context(pipeline_stages=0)"),
    ("pipeline_stages='2'", "ms.set_auto_parallel_context(pipeline_stages='2')"),
    ("parallel_optimizer_config='level1'", "ms.set_auto_parallel_context(parallel_optimizer_config='level1')"),
    ("full_batch with dataset_strategy",
     "ms.set_auto_parallel_context(full_batch=True, dataset_strategy=((2, 1),))"),
    ("dataset_strategy then full_batch",
     "ms.set_auto_parallel_context(dataset_strategy=((2, 1),))\nms.set_auto_parallel_context(full_batch=True)"),
    ("dataset_strategy='model_parallel'", "ms.set_auto_parallel_context(dataset_strategy='model_parallel')"),
    ("max_device_memory=-1", "ms.set_auto_parallel_context(max_device_memory=-1)"),
    ("loss_repeated_mean='no'", "ms.set_auto_parallel_context(loss_repeated_mean='no')"),
    ("set_auto_parallel_context unknown key", "ms.set_auto_parallel_context(bogus_key=1)"),
    ("get_auto_parallel_context unknown key", "ms.get_auto_parallel_context('bogus')"),
    ("set_ps_context unknown key", "ms.set_ps_context(bogus=1)"),
    ("set_ps_context(enable_ssl='no')", "ms.set_ps_context(enable_ssl='no')"),
]

for _name, _code in BAD:
    def _fn(ctx, code=_code):
        return ctx.python(f"import autopar as ms\n{code}\nprint('ACCEPTED')\n")
    case("context", _name)(_fn)


INIT_THEN = """
import autopar as ms
ms.set_auto_parallel_context(parallel_mode='data_parallel', {before})
ms.init()
{after}
print('ACCEPTED', ms.get_auto_parallel_context('device_num'))
"""


def _named(run, value: str) -> Verdict:
    """Accepted if the script got through; a clear error only if it names the value (a job that failed for another
    reason -- a timeout on a loaded machine -- is not this check at work)."""
    if "ACCEPTED" in run.text:
        return Verdict(run, "accepted")
    return Verdict(run, None if value in run.err + run.out else "traceback", "" if value in run.err + run.out
                   else "failed without naming the value")


@case("context", "device_num=4 on 2 ranks (before init)")
def device_num_before(ctx):
    return _named(ctx.launch(2, ctx.script(INIT_THEN.format(before="device_num=4", after=""))), "device_num=4")


@case("context", "device_num=4 on 2 ranks (after init)")
def device_num_after(ctx):
    return _named(ctx.launch(2, ctx.script(INIT_THEN.format(before="gradients_mean=True",
                                                            after="ms.set_auto_parallel_context(device_num=4)"))),
                  "device_num=4")


@case("context", "global_rank=5 on 2 ranks")
def global_rank_after(ctx):
    return _named(ctx.launch(2, ctx.script(INIT_THEN.format(before="global_rank=5", after=""))), "global_rank=5")
