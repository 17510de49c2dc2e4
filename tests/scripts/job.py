"""A small worker script whose behaviour the tests steer through the environment.

JOB_STEPS (default 20) all-reduce steps, JOB_SLEEP seconds between them; at step JOB_FAIL_STEP the rank
JOB_FAIL_RANK fails as JOB_FAIL_MODE says: "raise" (an exception), "kill" (SIGKILL itself), "exit3" (os._exit(3)),
"hang" (stop communicating). JOB_END_STATUS=k makes rank JOB_FAIL_RANK end with ``sys.exit(k)`` after all steps
(``exit(k)``, the builtin, when JOB_END_CALL=builtin). With JOB_UNTIL_FILE the ranks stop together, before JOB_STEPS,
at the first step after that file appears (a test's "now finish", instead of a job long enough for the worst case).
Prints "RANK r OF n local l/m contract c" first and "RANK r DONE" at the end.
"""
import os
import signal
import sys
import time

import torch

import autopar
import autopar.comm as C
from autopar.comm import management

autopar.init()
r, n = autopar.get_rank(), autopar.get_group_size()
print(f"RANK {r} OF {n} local {autopar.get_local_rank()}/{autopar.get_local_size()} contract {management.contract()}",
      flush=True)
steps = int(os.environ.get("JOB_STEPS", "20"))
fail_rank = int(os.environ.get("JOB_FAIL_RANK", "-1"))
fail_step = int(os.environ.get("JOB_FAIL_STEP", "3"))
mode = os.environ.get("JOB_FAIL_MODE", "raise")
until = os.environ.get("JOB_UNTIL_FILE")
for step in range(steps):
    if r == fail_rank and step == fail_step:
        print(f"RANK {r} FAILING ({mode}) at step {step}", flush=True)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif mode == "exit3":
            os._exit(3)
        elif mode == "hang":
            time.sleep(3600)
        else:
            raise ValueError(f"injected failure at step {step}")
    # the second slot agrees on the stop: every rank leaves at the same step even if only one saw the file yet
    total = C.all_reduce(torch.tensor([1.0, float(bool(until) and os.path.exists(until))]))
    assert total[0].item() == n
    if total[1].item() > 0:
        break
    time.sleep(float(os.environ.get("JOB_SLEEP", "0.05")))
print(f"RANK {r} DONE", flush=True)
if r == fail_rank and os.environ.get("JOB_END_STATUS"):
    status = int(os.environ["JOB_END_STATUS"])
    exit(status) if os.environ.get("JOB_END_CALL") == "builtin" else sys.exit(status)
