"""The parallel modes the GPT test scripts name (dryrun_gpt.py, cuda_gpt.py): dp, zero1, zero2, zero3,
semi_megatron (Megatron strategies by ``autopar.shard``), semi_megatron_sp (and the norms and dropouts split on the
sequence), cp (context parallelism: the inputs' sequence split over every rank), cp_ring (and attention as a ring),
ep (the experts of the scripts' mixture-of-experts MLPs spread over the ranks), pipeline, auto."""
import autopar

GPT_COLUMNS, GPT_ROWS = ("attn.c_attn", "mlp.c_fc"), ("attn.c_proj", "mlp.c_proj")


def set_mode(mode: str) -> None:
    name = {"auto": "auto_parallel", "semi_megatron": "semi_auto_parallel",
            "semi_megatron_sp": "semi_auto_parallel", "cp": "semi_auto_parallel",
            "cp_ring": "semi_auto_parallel", "ep": "semi_auto_parallel"}.get(mode, "data_parallel")
    autopar.set_auto_parallel_context(parallel_mode=name, gradients_mean=True)
    if mode.startswith("cp"):
        n = autopar.communication.get_group_size()
        autopar.set_auto_parallel_context(dataset_strategy=((1, n), (1, n)),
                                          context_parallel_algo="ring" if mode == "cp_ring" else "all_gather")
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


GPT_SPLITS = ("ln_1", "ln_2", "ln_f", "drop", "resid_dropout", "mlp.dropout")


def sequence_parallel(model, n: int) -> None:
    """Megatron's sequence parallelism beside :func:`megatron`: the norms and dropouts split on the sequence."""
    for name, module in model.named_modules():
        if name.endswith(GPT_SPLITS):
            autopar.shard(module, ((1, n, 1),))
