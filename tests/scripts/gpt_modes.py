"""The parallel modes the GPT test scripts name (dryrun_gpt.py, cuda_gpt.py): dp, zero1, zero2, zero3,
semi_megatron (Megatron strategies by ``autopar.shard``), pipeline, auto."""
import autopar

GPT_COLUMNS, GPT_ROWS = ("attn.c_attn", "mlp.c_fc"), ("attn.c_proj", "mlp.c_proj")


def set_mode(mode: str) -> None:
    name = {"auto": "auto_parallel", "semi_megatron": "semi_auto_parallel"}.get(mode, "data_parallel")
    autopar.set_auto_parallel_context(parallel_mode=name, gradients_mean=True)
    if mode.startswith("zero"):
        autopar.set_auto_parallel_context(enable_parallel_optimizer=True,
                                          parallel_optimizer_config={"optimizer_level": f"level{mode[-1]}"})


def megatron(model, n: int, columns=GPT_COLUMNS, rows=GPT_ROWS) -> None:
    """The first projection of attention and MLP split by columns, the second by rows (nn.Linear's tuples)."""
    for name, module in model.named_modules():
        if name.endswith(columns):
            autopar.shard(module, ((1, 1, 1), (n, 1)))
        elif name.endswith(rows):
            autopar.shard(module, ((1, 1, n), (1, n)))
