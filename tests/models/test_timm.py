"""timm's ``VisionTransformer`` (a cls token and a position-embedding parameter concatenated/added inside
``forward``) as its users train it, in every mode of the PyTorch door (Megatron: the MLP and the attention's output
projection; timm's fused qkv split by columns below): tiny config, float64, AdamW + 2 micro-steps + ``clip_grad_norm_(1.0)`` -- equal to one process on the same global batches, and ``state_dict()`` loading into a
fresh one-process model. One launch runs every case (tests/scripts/hf_train.py)."""
import pytest

from procutil import autopar_cmd

from hf_cases import train_cases

pytest.importorskip("timm")

MODES = ["data", "zero1", "zero3", "semi", "megatron", "names", "auto", "auto_explicit", "auto_megatron", "pipe"]


def test_timm_vit_trains_exactly_in_every_mode(procs, tmp_path):
    for _, case, r in train_cases(procs, tmp_path, [["vit", mode] for mode in MODES]):
        if case.endswith(("/megatron", "/names", "/auto_megatron")):  # the MLP and the attention's output projection
            assert {"blocks.0.mlp.fc1.weight", "blocks.1.attn.proj.weight"} <= set(r["split"]), (case, r)


FUSED_QKV = """import sys
import torch
import autopar
from torch.distributed.tensor import DTensor
from timm.models.vision_transformer import VisionTransformer

autopar.communication.init()
torch.set_default_dtype(torch.float64)
heads = int(sys.argv[1])


def vit():
    torch.manual_seed(0)
    return VisionTransformer(img_size=16, patch_size=8, embed_dim=8 * heads, depth=1, num_heads=heads, num_classes=5)


x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))  # the same on every rank: full_batch
ref = vit()
ref(x).sum().backward()
autopar.set_auto_parallel_context(parallel_mode="semi_auto_parallel", full_batch=True)
model = vit()
autopar.shard(model.blocks[0].attn.qkv, "colwise")
autopar.shard(model.blocks[0].attn.proj, "rowwise")
seen = {}
model.blocks[0].attn.proj.register_forward_pre_hook(lambda m, a: seen.update(local=a[0].to_local().shape[-1]))
out = model(x)
out.sum().backward()
grad = model.blocks[0].attn.qkv.weight.grad
grad = grad.full_tensor() if isinstance(grad, DTensor) else grad
out = out.full_tensor() if isinstance(out, DTensor) else out
print("RESULT", (out - ref(x)).abs().max().item(), (grad - ref.blocks[0].attn.qkv.weight.grad).abs().max().item(),
      seen["local"], flush=True)
"""


@pytest.mark.parametrize("n", [2, 4])
def test_a_column_split_of_timms_fused_qkv_splits_attention_by_heads(procs, tmp_path, n):
    """timm's qkv is one Linear whose outputs are reshaped to (3, heads, head_dim): split by columns, each rank's
    features would cross q, k and v -- they are cut into q, k and v (one all-to-all), each split by heads, and the
    attention's output reaches the row-split projection split too; forward and gradients as one process's
    (float64). Where the ranks do not divide the heads, one line says so and what works instead, not DTensor's
    traceback."""
    script = tmp_path / "vit_qkv.py"
    script.write_text(FUSED_QKV)
    res = procs.run(autopar_cmd("launch", "-n", str(n), "--log-dir", str(tmp_path / "logs"), str(script), "4"),
                    timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    results = [line.split()[-3:] for line in res.stdout.splitlines() if "RESULT" in line]
    assert len(results) == n, res.stdout
    for out, grad, local in results:
        assert float(out) <= 1e-12 and float(grad) <= 1e-12 and int(local) == 32 // n, results
    if n == 4:
        return
    res = procs.run(autopar_cmd("launch", "-n", "2", "--log-dir", str(tmp_path / "logs3"), str(script), "3"),
                    timeout=240)
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr
    line = [e for e in res.stderr.splitlines() if e.startswith("autopar: error:")]
    assert len(line) == 1 and "a [2, 5, 72] tensor split on its dimension 2 (S(2)) is reshaped to [2, 5, 3, 3, 8]" \
        in line[0] and "the ranks that split it do not divide the first new dimension (3)" in line[0] and \
        "leave that projection whole and split the attention's output projection and the MLP" in line[0], res.stderr
