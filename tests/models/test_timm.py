"""timm's ``VisionTransformer`` (a cls token and a position-embedding parameter concatenated/added inside
``forward``) as its users train it, in every mode of the PyTorch door (Megatron: the MLP and the attention's output
projection; timm's fused qkv is left whole -- its columns are (3, heads, head_dim) and a plain column split would
cut across q, k and v): tiny config, float64, AdamW + 2 micro-steps + ``clip_grad_norm_(1.0)`` -- equal to one process on the same global batches, and ``state_dict()`` loading into a
fresh one-process model. One launch runs every case (tests/scripts/hf_train.py)."""
import pytest

from hf_cases import train_cases

pytest.importorskip("timm")

MODES = ["data", "zero1", "zero3", "semi", "megatron", "names", "auto", "auto_explicit", "auto_megatron", "pipe"]


def test_timm_vit_trains_exactly_in_every_mode(procs, tmp_path):
    for _, case, r in train_cases(procs, tmp_path, [["vit", mode] for mode in MODES]):
        if case.endswith(("/megatron", "/names", "/auto_megatron")):  # the MLP and the attention's output projection
            assert {"blocks.0.mlp.fc1.weight", "blocks.1.attn.proj.weight"} <= set(r["split"]), (case, r)
