"""Worker: labels of every dtype a pipeline yields reach torch's losses, metrics and collectives in every mode.

argv: OUT_PREFIX. For label dtypes {uint8, uint32, int32, int64, float16, float32, bool} x modes {data, semi_auto,
auto, hybrid} x losses {torch CrossEntropyLoss, torch NLLLoss, NLLLoss after log_softmax in a function,
SoftmaxCrossEntropyExpand}: Model.train (2 steps), Model.eval with metrics {"acc", "loss"} and Model.predict must
run; the loss after training must equal the same run with int64 labels (bool: int64 labels 0/1). A regression loss
given float labels must still see them as floats (a user's own cast wins). Collectives on
uint16/uint32/uint64/bool/float16 must come back in their dtype, exact.
Writes {case: result} to OUT_PREFIX.<rank>.
"""
import json
import sys

import numpy as np
import torch
import torch.nn.functional as F

import autopar
from autopar.comm import functional as C
from autopar.communication import get_group_size, get_rank, init
from autopar.nn import SoftmaxCrossEntropyExpand
from autopar.train import Model

out_prefix = sys.argv[1]
init()
rank, n = get_rank(), get_group_size()
rng = np.random.default_rng(1)
X = torch.tensor(rng.standard_normal((3, 4, 8)).astype(np.float32))  # 3 batches of 4 per rank
Y = rng.integers(0, 5, (3, 4))
MODES = {"data": "data_parallel", "semi_auto": "semi_auto_parallel", "auto": "auto_parallel",
         "hybrid": "hybrid_parallel"}


def nll(logits, y):
    return F.nll_loss(F.log_softmax(logits, -1), y)


LOSSES = {"CrossEntropyLoss": torch.nn.CrossEntropyLoss, "NLLLoss": torch.nn.NLLLoss, "NLLLoss_function": lambda: nll,
          "SoftmaxCrossEntropyExpand": lambda: SoftmaxCrossEntropyExpand(sparse=True)}


def run(mode: str, loss: str, dtype: torch.dtype, labels: np.ndarray = Y) -> dict:
    autopar.reset_auto_parallel_context()
    autopar.set_auto_parallel_context(parallel_mode=MODES[mode], gradients_mean=True)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5))
    if mode == "semi_auto":
        autopar.shard(net[0], ((1, 1), (n, 1)))
    data = [(X[i], torch.from_numpy(labels[i]).to(dtype)) for i in range(3)]
    loss_fn = LOSSES[loss]() if loss in LOSSES else loss
    model = Model(net, loss_fn, torch.optim.SGD(net.parameters(), lr=0.1), metrics={"acc", "loss"})
    model.train(1, data[:2])
    metrics = model.eval(data[2:])
    pred = model.predict(X[2])
    return {"acc": metrics["acc"], "loss": metrics["loss"], "pred_shape": list(pred.shape)}


results = {}
for mode in MODES:
    for loss in LOSSES:
        base = {}
        for dtype in (torch.int64, "int64_binary", torch.uint8, torch.uint32, torch.int32, torch.float16,
                      torch.float32, torch.bool):
            binary = dtype in (torch.bool, "int64_binary")
            name = dtype if isinstance(dtype, str) else str(dtype).replace("torch.", "")
            key = f"{mode}/{loss}/{name}"
            try:
                got = run(mode, loss, torch.int64 if dtype == "int64_binary" else dtype, Y % 2 if binary else Y)
                base.setdefault(binary, got)
                got["loss_vs_int64"] = abs(got["loss"] - base[binary]["loss"])
                results[key] = got
            except Exception as exc:  # noqa: BLE001 - recorded: the test names the case
                results[key] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
seen = []


def regression(logits, y):
    seen.append(str(y.dtype))
    return F.mse_loss(logits[:, 0], y)


for mode in MODES:  # a regression on float labels: the loss sees them as floats, never as class indices
    seen.clear()
    try:
        got = run(mode, regression, torch.float32)
        results[f"regression/{mode}"] = {"loss_dtypes": sorted(set(seen)), "loss": got["loss"]}
    except Exception as exc:  # noqa: BLE001
        results[f"regression/{mode}"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
for dtype in (torch.uint16, torch.uint32, torch.uint64, torch.bool, torch.float16, torch.uint8):
    name = str(dtype).replace("torch.", "")
    t = (torch.arange(6) + 60000 * (rank + 1)).to(dtype) if dtype != torch.bool else torch.tensor([rank % 2 == 0] * 3)
    try:
        gathered = C.all_gather(t)
        parts = [(torch.arange(6) + 60000 * (r + 1)).to(dtype) if dtype != torch.bool else
                 torch.tensor([r % 2 == 0] * 3) for r in range(n)]
        expected_sum = sum(p.double() for p in parts)
        summed = C.all_reduce(t)
        results[f"collective/{name}"] = {
            "gather_dtype": str(gathered.dtype), "gather_exact": bool(torch.equal(gathered, torch.cat(parts))),
            "broadcast_exact": bool(torch.equal(C.broadcast(t, 0), parts[0])),
            "sum_dtype": str(summed.dtype),
            "sum_exact": bool(torch.equal(summed, expected_sum.to(dtype))) if dtype != torch.bool else
            bool(torch.equal(summed, expected_sum > 0))}
    except Exception as exc:  # noqa: BLE001
        results[f"collective/{name}"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
json.dump(results, open(f"{out_prefix}.{rank}", "w"), indent=1)
print(f"RANK {rank} DONE", flush=True)
