"""timm's ``VisionTransformer`` (a cls token and a position-embedding parameter concatenated/added inside
``forward``) as its users train it, in every mode of the PyTorch door (Megatron: the MLP and the attention's output
projection; timm's fused qkv is left whole -- its columns are (3, heads, head_dim) and a plain column split would
cut across q, k and v): tiny config, float64, AdamW + 2 micro-steps + ``clip_grad_norm_(1.0)`` -- equal to one process on the same global batches, and ``state_dict()`` loading into a
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


FUSED_QKV = """import torch
import autopar
from timm.models.vision_transformer import VisionTransformer

autopar.communication.init()
autopar.set_auto_parallel_context(parallel_mode="semi_auto_parallel")
model = VisionTransformer(img_size=16, patch_size=8, embed_dim=32, depth=1, num_heads=4, num_classes=5)
autopar.shard(model.blocks[0].attn.qkv, "colwise")
autopar.shard(model.blocks[0].attn.proj, "rowwise")
model(torch.randn(2, 3, 16, 16)).sum().backward()
"""


def test_a_column_split_of_timms_fused_qkv_is_one_line(procs, tmp_path):
    """timm's qkv is one Linear whose outputs are reshaped to (3, heads, head_dim): split by columns, a rank's
    features cross q, k and v and DTensor refuses the reshape deep in its sharding propagation -- the user sees
    one line saying so and what works instead, not that traceback."""
    script = tmp_path / "vit_qkv.py"
    script.write_text(FUSED_QKV)
    res = procs.run(autopar_cmd("launch", "-n", "2", "--log-dir", str(tmp_path / "logs"), str(script)), timeout=240)
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr
    line = [e for e in res.stderr.splitlines() if e.startswith("autopar: error:")]
    assert len(line) == 1 and "a [4, 5, 96] tensor split on its dimension 2 (S(2)) is reshaped to [4, 5, 3, 4, 8]" \
        in line[0] and "leave that projection whole and split the attention's output projection and the MLP" in \
        line[0], res.stderr
