"""``Model(network, loss_fn, optimizer, metrics).train / eval / predict`` -- MindSpore's high-level API.

The parallel mode comes from ``set_auto_parallel_context`` (read when training starts); the network is prepared
once by :func:`autopar.parallel.api.prepare` and every step is the same few lines for every mode: forward, loss,
backward (with gradient communication suppressed on the first k-1 micro-batches of an accumulation), the mode's
post-backward hook, optimizer step.
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Iterable, Iterator

import torch

from autopar import context as _context
from autopar.comm import management as _comm
from autopar.context import ParallelMode, log_dir  # noqa: F401  (mindspore.train.model.ParallelMode, r0.x)
from autopar.errors import ACCUMULATE_INSTEAD, ConfigError, TrainingError, refuses
from autopar.labels import call_loss, class_indices
from autopar.train.callbacks import (
    Callback,
    CallbackList,
    CallbackParams,
    MetricsRecorder,
    ProgressBar,
    RunContext,
    output_is_terminal,
)
from autopar.train.metrics import Loss, build_metrics


def _epoch_batches(dataset: Any, epoch: int) -> Iterator:
    """One epoch of batches: autopar datasets by epoch number (deterministic, resumable); any other iterable
    (e.g. a torch DataLoader, whose DistributedSampler gets ``set_epoch``) by plain iteration."""
    if hasattr(dataset, "iter_epoch"):
        return iter(dataset.iter_epoch(epoch))
    sampler = getattr(dataset, "sampler", None)
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    return iter(dataset)


def _steps_per_epoch(dataset: Any) -> int:
    if hasattr(dataset, "get_dataset_size"):
        return int(dataset.get_dataset_size())
    try:
        return len(dataset)
    except TypeError:
        raise ConfigError("the training dataset has no length: give get_dataset_size() or __len__") from None


def sinks(device: torch.device) -> bool:
    """Does ``dataset_sink_mode`` sink on this device? MindSpore sinks on accelerators only: on a CPU it trains step
    by step (every step reported, ``sink_size`` without effect)."""
    return device.type != "cpu"


_noticed: set[str] = set()


def _notice_once(key: str, message: str) -> None:
    if key not in _noticed:
        _noticed.add(key)
        print(message, file=sys.stderr, flush=True)


def _batch_size(batch: Any) -> int:
    first = batch[0] if isinstance(batch, (tuple, list)) else batch
    return int(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() else 1


class Model:
    def __init__(self, network: torch.nn.Module, loss_fn: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, metrics: Any = None,
                 eval_network: torch.nn.Module | None = None, eval_indexes: Any = None, amp_level: str = "O0",
                 grad_accumulation_steps: int | None = None, **kwargs: Any):
        if not isinstance(network, torch.nn.Module):
            raise ConfigError(f"Model needs a torch.nn.Module network, got {type(network).__name__}")
        self._network = network
        self._loss_fn = loss_fn
        self._optimizer = optimizer
        self._metrics = build_metrics(metrics)
        self._eval_network = eval_network
        from autopar.train.precision import LEVELS

        if str(amp_level).upper() not in LEVELS:
            raise ConfigError(f"amp_level must be one of {', '.join(LEVELS)}, got {amp_level!r}")
        self._amp_level = str(amp_level).upper()
        self._precision = None
        steps = (grad_accumulation_steps if grad_accumulation_steps is not None
                 else _context.auto_parallel_context().grad_accumulation_step)
        if not isinstance(steps, int) or steps < 1:
            raise ConfigError(f"grad_accumulation_steps must be a positive integer, got {steps!r}")
        self._accumulation = steps
        self._prepared = None
        self._unloaded = False  # a failed resume_from= left the network without values
        self._micro_step = 0

    @refuses("Model._build_train_network", ACCUMULATE_INSTEAD)  # r1.3's Model_ACCU calls it
    def _build_train_network(self, *args: Any, **kwargs: Any): ...

    # -- properties MindSpore users reach for ------------------------------------------------------------------
    @property
    def train_network(self) -> torch.nn.Module:
        return self._network

    @property
    def predict_network(self) -> torch.nn.Module:
        return self._network

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self._optimizer

    # -- preparation ----------------------------------------------------------------------------------------------
    def _prepare(self, sample: Any = None):
        if self._unloaded:
            raise ConfigError("the resume_from= that failed left what this network was to read from the checkpoint "
                              "without values: build the network (and its optimizer) again")
        if self._prepared is None:
            from autopar.parallel.api import prepare

            if sample is not None:
                sample = [t.to(_comm.device()) if isinstance(t, torch.Tensor) and _comm.is_initialized() else t
                          for t in (sample if isinstance(sample, (tuple, list)) else [sample])]
                if self._loss_fn is not None:
                    sample = sample[:-1] + [class_indices(sample[-1])]
            from autopar.train.precision import make_precision

            # before prepare(): O3 casts the parameters, which must happen before the reducer lays out its buckets
            device = _comm.device() if _comm.is_initialized() else torch.device("cpu")
            self._precision = make_precision(self._amp_level, device, self._network)
            self._prepared = prepare(self._network, self._loss_fn, self._optimizer, sample=sample)
        return self._prepared

    def _to_device(self, batch: Any) -> list:
        prepared = self._prepare(batch)
        items = batch if isinstance(batch, (tuple, list)) else [batch]
        items = [t.to(prepared.device, non_blocking=True) if isinstance(t, torch.Tensor) else t for t in items]
        if prepared.channels_last:
            from autopar.perf.tuning import channels_last_inputs

            items = channels_last_inputs(items)
        return self._precision.cast_inputs(items)

    def _forward_loss(self, inputs: list) -> torch.Tensor:
        if self._loss_fn is not None:
            if len(inputs) < 2:
                raise ConfigError("with a loss_fn the dataset must yield (inputs..., label)")
            inputs = inputs[:-1] + [class_indices(inputs[-1])]
        prepared = self._prepare()
        with self._precision.autocast():
            return prepared.forward_loss(inputs)

    # -- one step ----------------------------------------------------------------------------------------------
    def _train_step(self, batch: Any) -> torch.Tensor:
        prepared = self._prepare()
        inputs = self._to_device(batch)
        self._micro_step += 1
        last = self._micro_step % self._accumulation == 0
        sync = prepared.no_sync if not last else contextlib.nullcontext
        if prepared.runs_backward:  # the pipeline: forward and backward over the micro-batches in one schedule
            if self._accumulation > 1:
                raise ConfigError("grad_accumulation_steps with pipeline_stages: the pipeline's micro_size already "
                                  "accumulates over micro-batches")
            loss = self._forward_loss(inputs)
            self._precision.step(self._optimizer)
            self._optimizer.zero_grad(set_to_none=True)
            return loss
        scale = 1.0 / self._accumulation
        micro = self._accumulated_micro_batches(inputs)
        if micro is None:
            with sync():
                loss = self._forward_loss(inputs)
                self._backward(loss, scale)
        else:  # GradAccumulationCell: each micro-batch's backward on its own, only the very last one communicates
            losses = []
            for k, chunk in enumerate(micro):
                with sync() if k == len(micro) - 1 else prepared.no_sync():
                    with self._precision.autocast():
                        loss = self._network.network(*chunk)
                    self._backward(loss, scale)
                    losses.append(loss.detach())
            loss = torch.stack(losses).sum(0)
        if last:
            self._precision.step(self._optimizer)
            self._optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def _backward(self, loss: Any, scale: float) -> None:
        if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
            raise TrainingError(f"the loss must be a tensor that depends on the parameters, got "
                                f"{getattr(loss, 'shape', type(loss).__name__)!r}")
        self._precision.backward(loss * scale if scale != 1.0 else loss)

    def _accumulated_micro_batches(self, inputs: list) -> list | None:
        """``nn.GradAccumulationCell``: the batch's micro-batches, each a list of the inner cell's inputs."""
        from autopar.nn.wrappers import GradAccumulationCell

        cell = self._network
        if not isinstance(cell, GradAccumulationCell) or self._loss_fn is not None:
            return None
        return cell.micro_batches(*inputs)

    # -- training loop ------------------------------------------------------------------------------------------
    def train(self, epoch: int, train_dataset: Iterable, callbacks: Callback | list[Callback] | None = None,
              dataset_sink_mode: bool = False, sink_size: int = -1, initial_epoch: int = 0,
              resume_from: str | os.PathLike | None = None) -> None:
        """Train ``epoch`` epochs. ``resume_from``: a ModelCheckpoint directory (``{rank}`` is replaced by the rank):
        training continues after the newest checkpoint every rank completed, with its parameters, optimizer state,
        RNG state and data position -- the remaining steps are those of an uninterrupted run."""
        if self._optimizer is None:
            raise ConfigError("Model.train needs an optimizer: Model(network, loss_fn, optimizer)")
        if not isinstance(epoch, int) or epoch < 1:
            raise ConfigError(f"epoch must be a positive integer, got {epoch!r}")
        dataset_steps = _steps_per_epoch(train_dataset)
        cbs = list(callbacks) if isinstance(callbacks, (list, tuple)) else ([callbacks] if callbacks else [])
        ctx = _context.auto_parallel_context()
        auto = ctx.parallel_mode is _context.ParallelMode.AUTO_PARALLEL
        found = marked = None
        if resume_from is not None:
            from autopar.checkpoint.api import find_resume, resolve_rank_path, sliced_names
            from autopar.common import deferred
            from autopar.train.checkpointing import ModelCheckpoint

            where = resolve_rank_path(resume_from)
            prefixes = {cb.prefix for cb in cbs if isinstance(cb, ModelCheckpoint)
                        and resolve_rank_path(cb.directory).resolve() == where.resolve()}
            prefix = prefixes.pop() if len(prefixes) == 1 else None
            found = find_resume(where, prefix)
            # a network built on the meta device: what the checkpoint holds is read straight into each rank's slices,
            # never computed first -- where the mode may slice (AUTO plans a meta-built network without making it,
            # then makes what its plan keeps; data parallel keeps it whole and compares the ranks' values: theirs
            # are drawn)
            slices = auto or ctx.parallel_mode is ParallelMode.SEMI_AUTO_PARALLEL or ctx.enable_parallel_optimizer
            marked = deferred.expect_loaded(self._network, sliced_names(found)) \
                if self._prepared is None and slices else []
        reading = False
        try:
            if self._prepared is None and auto:  # AUTO_PARALLEL plans on real shapes: give it the first batch
                self._prepare(next(_epoch_batches(train_dataset, 0)))
            prepared = self._prepare()
            rank = _comm.get_rank() if _comm.is_initialized() else 0
            if dataset_sink_mode and not sinks(prepared.device):
                dataset_sink_mode = False
                if rank == 0:
                    _notice_once("sink", "autopar: dataset_sink_mode=True trains step by step on the CPU, as MindSpore "
                                 "does (\"The CPU cannot support dataset sink mode currently\"): every step reports, "
                                 "and sink_size has no effect (Dataset.take(n) shortens an epoch)")
            per_epoch = sink_size if dataset_sink_mode and sink_size and sink_size > 0 else dataset_steps
            if per_epoch < 1:
                raise ConfigError("the training dataset is empty (0 batches per epoch)")
            start = initial_epoch * per_epoch
            if resume_from is not None:
                from autopar.checkpoint.api import resume_state

                reading = True
                meta = resume_state(where, self._network, self._optimizer, prefix, found=found)
                reading = False
                if marked:
                    deferred.check_loaded(self._network, marked, str(found.path))
        except BaseException:
            if marked or (reading and _holds_nan(self._network)):  # what was left for the checkpoint holds no
                # value (a read that failed part-way leaves NaN where it did not read): this network cannot train
                deferred.forget_loaded()
                self._unloaded = True
            raise
        if resume_from is not None:
            if meta is not None:
                start = meta.global_step
                self._micro_step = start
                scaler_state = meta.loop_state.get("grad_scaler")
                if scaler_state and self._precision.scaler is not None:
                    self._precision.scaler.load_state_dict(scaler_state)
                if rank == 0:
                    print(f"[autopar] resumed from {where} after step {start} (epoch {meta.epoch})", flush=True)
        if rank == 0:
            cbs.append(MetricsRecorder(log_dir()))
            if output_is_terminal():  # never a bar in a log (mpirun's forwarded output included)
                cbs.append(ProgressBar())
        cb_list = CallbackList(cbs)
        params = CallbackParams(
            train_network=self._network, optimizer=self._optimizer, loss_fn=self._loss_fn, epoch_num=epoch,
            batch_num=per_epoch, cur_epoch_num=start // per_epoch, cur_step_num=start,
            net_outputs=None, parallel_mode=prepared.mode.value, device_number=prepared.world_size,
            train_dataset=train_dataset, dataset_sink_mode=dataset_sink_mode, mode="train", rank=rank,
            global_batch_size=0, steps_since_callback=1, grad_accumulation_steps=self._accumulation,
            grad_scaler=self._precision.scaler,
        )
        run_context = RunContext(params)
        self._network.train()
        stream = self._stream(train_dataset, start, dataset_steps)
        cb_list.on_train_begin(run_context)
        for ep in range(start // per_epoch, epoch):
            params.cur_epoch_num = ep + 1
            cb_list.on_train_epoch_begin(run_context)
            for i in range(start - ep * per_epoch if ep == start // per_epoch else 0, per_epoch):
                batch = next(stream)
                if not dataset_sink_mode:
                    cb_list.on_train_step_begin(run_context)
                params.net_outputs = self._train_step(batch)
                params.cur_step_num += 1
                params.global_batch_size = _batch_size(batch) * prepared.world_size
                if not dataset_sink_mode:
                    cb_list.on_train_step_end(run_context)
                elif i == per_epoch - 1:  # MindSpore reports once per sink
                    params.steps_since_callback = per_epoch
                    cb_list.on_train_step_end(run_context)
                if run_context.get_stop_requested():
                    break
            cb_list.on_train_epoch_end(run_context)
            if run_context.get_stop_requested():
                break
        prepared.sync_parameters()  # a pipeline trained each stage on its ranks: the whole network current everywhere
        cb_list.on_train_end(run_context)

    @staticmethod
    def _stream(dataset: Any, start_step: int, dataset_steps: int) -> Iterator:
        """Batches from global step ``start_step`` on, across dataset epochs (sink mode may cut epochs anywhere)."""
        epoch, offset = divmod(start_step, dataset_steps)
        while True:
            it = _epoch_batches(dataset, epoch)
            if offset:
                if hasattr(dataset, "iter_epoch"):
                    it = iter(dataset.iter_epoch(epoch, start_step=offset))
                else:
                    for _ in range(offset):
                        next(it)
            yield from it
            epoch, offset = epoch + 1, 0

    # -- layouts ------------------------------------------------------------------------------------------------
    def infer_train_layout(self, train_dataset: Iterable, dataset_sink_mode: bool = True, sink_size: int = -1) -> dict:
        """Every parameter's layout under the current parallel context, found by running the first batch (without
        gradients, BatchNorm in eval mode): what ``load_distributed_checkpoint`` reshards a checkpoint into."""
        batch = next(_epoch_batches(train_dataset, 0))
        prepared = self._prepare(batch)
        inputs = self._to_device(batch)
        was_training = self._network.training
        self._network.eval()
        with torch.no_grad():
            self._forward_loss(inputs)
        self._network.train(was_training)
        if prepared.runtime is not None:
            return prepared.runtime.layouts()
        from autopar.layout.layout import Layout

        return {n: Layout.replicated(tuple(p.shape), prepared.world_size) for n, p in self._network.named_parameters()}

    def infer_predict_layout(self, *predict_data: Any) -> dict:
        """Every parameter's layout when the network predicts on ``predict_data`` under the current parallel
        context (MindSpore's distributed inference: the layout ``load_distributed_checkpoint`` reshards the
        training slices into). Runs the network once, without gradients."""
        prepared = self._prepare(list(predict_data) if self._loss_fn is None else None)
        was_training = self._network.training
        self._network.eval()
        with torch.no_grad():
            self._network(*self._to_device(list(predict_data)))
        self._network.train(was_training)
        if prepared.runtime is not None:
            return prepared.runtime.layouts()
        from autopar.layout.layout import Layout

        return {n: Layout.replicated(tuple(p.shape), prepared.world_size) for n, p in self._network.named_parameters()}

    # -- evaluation / prediction -------------------------------------------------------------------------------
    def eval(self, valid_dataset: Iterable, callbacks: Any = None, dataset_sink_mode: bool = False) -> dict[str, float]:
        if not self._metrics:
            raise ConfigError("Model.eval needs metrics, e.g. Model(net, loss, opt, metrics={'acc'})")
        network = self._eval_network or self._network
        prepared = self._prepare()
        prepared.sync_parameters()
        for metric in self._metrics.values():
            metric.clear()
        was_training = network.training
        network.eval()
        with torch.no_grad():
            for batch in _epoch_batches(valid_dataset, 0):
                inputs = self._to_device(batch)
                with self._precision.autocast():
                    logits = network(*inputs[:-1])
                inputs[-1] = class_indices(inputs[-1])
                loss = call_loss(self._loss_fn, logits, inputs[-1]) if self._loss_fn is not None else None
                for metric in self._metrics.values():
                    if isinstance(metric, Loss):
                        metric.update(logits, inputs[-1], loss)
                    else:
                        metric.update(logits, inputs[-1])
        network.train(was_training)
        return {name: metric.eval() for name, metric in self._metrics.items()}

    def recompute_bn_statistics(self, dataset: Iterable, num_images: int = 512) -> int:
        """Precise BN (:mod:`autopar.train.precise_bn`): re-estimate the network's BatchNorm statistics on about
        ``num_images`` images of ``dataset`` (over all ranks; whole batches) before ``eval``. Weights are unchanged.
        Returns the number of images used over all ranks (0: the network has no BatchNorm)."""
        from autopar.train.precise_bn import recompute_batchnorm_statistics

        if num_images <= 0:
            raise ConfigError(f"recompute_bn_statistics: num_images must be positive, got {num_images}")
        world = _comm.get_group_size() if _comm.is_initialized() else 1
        per_rank = -(-num_images // world)
        seen = [0]

        def inputs():
            for batch in _epoch_batches(dataset, 0):
                if seen[0] >= per_rank:
                    return
                items = self._to_device(batch)
                items = items[:-1] if self._loss_fn is not None or len(items) > 1 else items
                seen[0] += int(items[0].shape[0]) if items[0].dim() else 1
                yield items

        self._prepare()
        batches = recompute_batchnorm_statistics(self._eval_network or self._network, inputs())
        return seen[0] * world if batches else 0

    def predict(self, *predict_data: Any) -> Any:
        network = self._network
        was_training = network.training
        network.eval()
        prepared = self._prepare()
        prepared.sync_parameters()
        with torch.no_grad(), self._precision.autocast():
            out = network(*self._to_device(list(predict_data)))
        network.train(was_training)
        return out


def _holds_nan(network: torch.nn.Module) -> bool:
    """Does any of ``network``'s floating-point parameters hold NaN on this rank (a checkpoint read that failed
    part-way)?"""
    for p in network.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if local.is_floating_point() and not local.is_meta and bool(torch.isnan(local.detach()).any()):
            return True
    return False
