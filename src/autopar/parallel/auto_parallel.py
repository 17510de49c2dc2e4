"""``mindspore.parallel.auto_parallel.AutoParallel`` (MindSpore 2.5+): the parallel configuration of one network,
as a wrapper -- a thin front over ``set_auto_parallel_context``.

``AutoParallel(net_or_function, parallel_mode="semi_auto")`` sets the parallel mode (``"semi_auto"`` ->
SEMI_AUTO_PARALLEL; ``"sharding_propagation"`` / ``"recursive_programming"`` -> AUTO_PARALLEL with that search
mode) and returns a Cell that calls what it wraps; each method sets the context keys it stands for, at once:

=====================================================  =========================================================
``hsdp(shard_size=-1, threshold=64, optimizer_level)``  ``enable_parallel_optimizer=True``, ``optimizer_weight_
                                                        shard_size``, ``parallel_optimizer_config``
``pipeline(stages, output_broadcast, interleave,``       ``pipeline_stages``, ``pipeline_config`` (scheduler,
``scheduler)``                                          interleave); ``output_broadcast=True`` refused
``dataset_strategy(config)``                            ``dataset_strategy`` ("full_batch": ``full_batch=True``)
``save_param_strategy_file`` / ``load_param_...``       ``strategy_ckpt_save_file`` / ``strategy_ckpt_load_file``
``comm_fusion(config)``                                 ``comm_fusion``
``enable_gradients_mean()``                             ``gradients_mean=True``
``disable_gradient_fp32_sync()`` / ``disable_loss_``    ``gradient_fp32_sync=False`` / ``loss_repeated_mean=``
``repeated_mean()``                                     ``False``
=====================================================  =========================================================

The network parallelizes itself at its first call, as any network does here (the wrapper is transparent to that:
wrapping a training-step *function* works too). Parameters made under ``nn.utils.no_init_parameters()`` are
materialised when the network is laid out: each rank only the slices it keeps. The remaining MindSpore methods (operator strategy files, local norms,
fp32 communication, ``transformer_opt`` ...) have nothing to act on here and raise one line at their first use.
"""
from __future__ import annotations

from typing import Any, Callable

from autopar import context
from autopar.errors import ConfigError, refuses, warn_once
from autopar.nn.cell import Cell

MODES = {"semi_auto": ("semi_auto_parallel", None), "sharding_propagation": ("auto_parallel", "sharding_propagation"),
         "recursive_programming": ("auto_parallel", "recursive_programming")}


class AutoParallel(Cell):
    _autopar_step_wrapper = True  # the network inside is the one that parallelizes itself on its first call

    def __init__(self, network: Callable, parallel_mode: str = "semi_auto"):
        super().__init__()
        if parallel_mode not in MODES:
            raise ConfigError(f"AutoParallel: parallel_mode must be one of {', '.join(MODES)}, got {parallel_mode!r}")
        if not callable(network):
            raise ConfigError(f"AutoParallel: network must be a Cell or a function, got {type(network).__name__}")
        self.network = network
        self.parallel_mode = parallel_mode
        mode, search = MODES[parallel_mode]
        context.set_auto_parallel_context(parallel_mode=mode, **({"search_mode": search} if search else {}))

    def construct(self, *args: Any, **kwargs: Any) -> Any:
        return self.network(*args, **kwargs)

    # -- methods that map onto context keys ---------------------------------------------------------------------
    def hsdp(self, shard_size: int = -1, threshold: int = 64, optimizer_level: str = "level1") -> None:
        if isinstance(shard_size, bool) or not isinstance(shard_size, int) or (shard_size <= 0 and shard_size != -1):
            raise ConfigError(f"AutoParallel.hsdp: shard_size must be a positive integer or -1, got {shard_size!r}")
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
            raise ConfigError(f"AutoParallel.hsdp: threshold must be a non-negative integer (KB), got {threshold!r}")
        if optimizer_level not in ("level1", "level2", "level3"):
            raise ConfigError(f"AutoParallel.hsdp: optimizer_level must be level1, level2 or level3, "
                              f"got {optimizer_level!r}")
        if threshold != 64:
            warn_once("AutoParallel.hsdp.threshold", f"AutoParallel.hsdp(threshold={threshold}) is accepted and not "
                      f"applied: every parameter is sharded, small ones too")
        context.set_auto_parallel_context(enable_parallel_optimizer=True, optimizer_weight_shard_size=shard_size,
                                          parallel_optimizer_config={"optimizer_level": optimizer_level})

    def pipeline(self, stages: int = 1, output_broadcast: bool = False, interleave: bool = False,
                 scheduler: str = "1f1b") -> None:
        if scheduler not in ("1f1b", "gpipe"):
            raise ConfigError(f"AutoParallel.pipeline: scheduler must be '1f1b' or 'gpipe', got {scheduler!r}")
        if output_broadcast:
            from autopar.errors import UnsupportedError

            raise UnsupportedError("AutoParallel.pipeline(output_broadcast=True) is not available in autopar: after "
                                   "Model.train every stage's parameters are broadcast, so evaluate the whole network "
                                   "with Model.eval / predict on any rank")
        context.set_auto_parallel_context(pipeline_stages=stages, pipeline_config={
            "pipeline_scheduler": scheduler, "pipeline_interleave": bool(interleave)})

    def dataset_strategy(self, config: Any) -> None:
        context.set_auto_parallel_context(dataset_strategy=config)

    def save_param_strategy_file(self, file_path: str) -> None:
        context.set_auto_parallel_context(strategy_ckpt_save_file=_path(file_path))

    def load_param_strategy_file(self, file_path: str) -> None:
        context.set_auto_parallel_context(strategy_ckpt_load_file=_path(file_path))

    def comm_fusion(self, config: dict) -> None:
        context.set_auto_parallel_context(comm_fusion=config)

    def enable_gradients_mean(self) -> None:
        context.set_auto_parallel_context(gradients_mean=True)

    def disable_gradient_fp32_sync(self) -> None:
        context.set_auto_parallel_context(gradient_fp32_sync=False)

    def disable_loss_repeated_mean(self) -> None:
        context.set_auto_parallel_context(loss_repeated_mean=False)

    def no_init_parameters_in_compile(self) -> None:
        """Parameters made under ``no_init_parameters`` are already materialised when the wrapper is built."""
        warn_once("AutoParallel.no_init_parameters_in_compile", "AutoParallel.no_init_parameters_in_compile() is "
                  "accepted: parameters are materialised whole before the parallel layout slices them")

    # -- methods with nothing to act on here ----------------------------------------------------------------------
    @refuses("AutoParallel.save_operator_strategy_file", "the planner writes its plan as the parameter strategy "
             "file: use save_param_strategy_file")
    def save_operator_strategy_file(self, file_path): ...

    @refuses("AutoParallel.load_operator_strategy_file", "load a parameter strategy file with "
             "load_param_strategy_file")
    def load_operator_strategy_file(self, file_path): ...

    @refuses("AutoParallel.disable_strategy_file_only_for_trainable_params", "the strategy file holds every "
             "parameter's layout already")
    def disable_strategy_file_only_for_trainable_params(self): ...

    @refuses("AutoParallel.set_group_ckpt_save_file", "communication groups are rebuilt from the mesh; nothing to save")
    def set_group_ckpt_save_file(self, file_path): ...

    @refuses("AutoParallel.print_local_norm", "compute norms in your loop (torch.linalg.vector_norm of p.grad)")
    def print_local_norm(self): ...

    @refuses("AutoParallel.dump_local_norm", "compute norms in your loop (torch.linalg.vector_norm of p.grad)")
    def dump_local_norm(self, file_path): ...

    @refuses("AutoParallel.enable_device_local_norm", "compute norms in your loop (torch.linalg.vector_norm of p.grad)")
    def enable_device_local_norm(self): ...

    @refuses("AutoParallel.enable_fp32_communication", "gradients are reduced in their own dtype; train in float32 "
             "or use Model(..., amp_level=...)")
    def enable_fp32_communication(self): ...

    @refuses("AutoParallel.transformer_opt", "its overlaps are Ascend graph-compiler passes")
    def transformer_opt(self, file_path): ...

    @refuses("AutoParallel.memory_offload", "parameters and activations stay in device memory")
    def memory_offload(self, config): ...


def _path(file_path: Any) -> str:
    if not isinstance(file_path, str):
        raise ConfigError(f"AutoParallel: file_path must be a string, got {type(file_path).__name__}")
    return file_path
