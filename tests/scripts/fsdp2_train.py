"""Run by tests/test_fsdp2.py: FP8 training with FSDP2 through the Trainer's ModelParallelStrategy, 2 CPU processes
on gloo (or one process without a strategy: the reference).

Usage: fsdp2_train.py OUT_DIR RECIPE MODE, MODE one of
  single     one process, batch 8: the reference losses and weights;
  fsdp2      2 processes (batch 4 each: the same global batches), float32 parameters: losses, weights, FP8 state of each
             rank, then a distributed checkpoint after one epoch and an exact resume; validation every 2 steps (FSDP2
             keeps the root's parameters, the LM head's among them, unsharded after an evaluation forward); the same
             checkpoint resumed into tensor parallel 2 x data parallel 1;
  tp         2 processes, tensor parallel 2 x data parallel 1: the MLPs column-wise / row-wise and the LM head
             column-wise (torch's ColwiseParallel / RowwiseParallel), then FSDP2 over the data-parallel mesh (FP8 all-gather
             on a 2-D mesh): losses and weights (the same batches on both ranks);
  errors     2 processes: a model sharded before conversion (configure_model without prepare_for_sharding) must stop
             the fit with a clear error; torch's plain ColwiseParallel on prepared layers trains, and warns that those
             weights gather in high precision;
  compiled   2 processes, float32 parameters, each block compiled in configure_model after fully_shard (``aot_eager``,
             ``fullgraph=True``), two micro-batches per optimizer step (``accumulate_grad_batches=2``), 2 epochs: the
             number of graphs compiled and the losses and amax histories, against the same run eager;
  bytes      2 processes, one training step each of two runs that gather the parameters FSDP2 does not gather in FP8 in
             bf16 (MixedPrecisionPolicy(param_dtype=bfloat16)): FP8 all-gather, and the same FP8 layers with every
             weight gathered in bf16. Bytes moved by FSDP2's parameter all-gathers per step (forward and backward).

Or ``main(OUT_DIR, RECIPE, MODE)`` from tests/scripts/gloo_checks.py (``single`` there runs before the launch, in the
first process only: ``single_process``).
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from models import TinyDecoder, loader  # noqa: E402
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard  # noqa: E402
from torch.distributed.tensor import Replicate  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402
from torch.utils.data import DistributedSampler  # noqa: E402

import lightning_fp8 as lf  # noqa: E402

N_DATA = 32 * 32 + 1  # 32 windows of 32 bytes + 1: 4 global batches of 8 per epoch
DIM = 128  # Linear weights are ~92% of the parameters (torchao's FP8 all-gather setting: Linear-dominated GPT)


class ShardedDecoder(TinyDecoder):
    def __init__(self, fp8_all_gather: bool = True, param_dtype: torch.dtype | None = None, prepare: bool = True, torch_styles: bool = False, compile_backend=None) -> None:
        super().__init__(dim=DIM, heads=4, layers=2)
        self.fp8_all_gather, self.param_dtype = fp8_all_gather, param_dtype
        self.prepare, self.torch_styles, self.compile_backend = prepare, torch_styles, compile_backend

    def configure_model(self):
        if self.device_mesh is None or isinstance(self, FSDPModule):  # one process: nothing to shard; sharded already
            return
        # before fully_shard: convert, and make the FP8 weights gather in FP8 (or not: the bf16 baseline)
        if self.prepare:
            lf.prepare_for_sharding(self, fp8_all_gather=self.fp8_all_gather)
        policy = MixedPrecisionPolicy(param_dtype=self.param_dtype)  # for what is not gathered in FP8
        if self.device_mesh["tensor_parallel"].size() > 1:
            tp_mesh = self.device_mesh["tensor_parallel"]
            colwise, rowwise = (ColwiseParallel, RowwiseParallel) if self.torch_styles else (lf.FP8ColwiseParallel, lf.FP8RowwiseParallel)
            for block in self.blocks:
                parallelize_module(block, tp_mesh, {"fc": colwise(), "out": rowwise()})
            parallelize_module(self.lm_head, tp_mesh, lf.FP8ColwiseParallel(output_layouts=Replicate()))
        mesh = self.device_mesh["data_parallel"]
        for block in self.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(self, mesh=mesh, mp_policy=policy)
        if self.compile_backend is not None:  # each sharded block on its own (torchtitan's way)
            for index, block in enumerate(self.blocks):
                self.blocks[index] = torch.compile(block, backend=self.compile_backend, fullgraph=True)

    def validation_step(self, batch, batch_idx):
        return self.loss(batch)

    def val_dataloader(self):
        return self.train_dataloader(n_data=16 * 32 + 1)

    def train_dataloader(self, n_data=N_DATA):
        """Global batches of 8 in order: rank r of n gets windows r, r + n, ... (the single-process run sees the same
        global batches)."""
        data = loader(n=n_data, batch_size=8).dataset
        if self.device_mesh is None:
            return torch.utils.data.DataLoader(data, batch_size=8)
        dp = self.device_mesh["data_parallel"]  # the tensor-parallel ranks see the same batches
        n = dp.size()
        sampler = DistributedSampler(data, num_replicas=n, rank=dp.get_local_rank(), shuffle=False)
        return torch.utils.data.DataLoader(data, batch_size=8 // n, sampler=sampler)


class Record(L.Callback):
    """Per training step: the loss averaged over ranks (tensor-parallel ranks hold the same loss) and the bytes FSDP2's all-gathers moved."""

    def __init__(self):
        self.losses, self.gathered, self.val_losses = [], [], []

    @staticmethod
    def mean(loss):
        loss = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        return loss.item()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(self.mean(outputs["loss"]))
        self.gathered.append(COUNTER[0])
        COUNTER[0] = 0

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        self.val_losses.append(self.mean(outputs))
        COUNTER[0] = 0


class AtTrainStart(L.Callback):
    """The model's FP8 state when training starts (after a checkpoint was restored)."""

    def on_train_start(self, trainer, pl_module):
        self.fp8 = lf.fp8_state_dict(pl_module)


COUNTER = [0]
# FSDP2's default all-gather calls it by this name at each call: all_gather_single from torch 2.13,
# all_gather_into_tensor before (as lightning_fp8.distributed does)
_ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
_all_gather = getattr(dist, _ALL_GATHER)


def counting_all_gather(output, input, *args, **kwargs):
    COUNTER[0] += input.numel() * input.element_size()
    return _all_gather(output, input, *args, **kwargs)


setattr(dist, _ALL_GATHER, counting_all_gather)


def trainer(out_dir, recipe, epochs, record, devices, tp=1, logger=False, callbacks=(), validate=False, **kwargs):
    kwargs.update(limit_val_batches=2, val_check_interval=2, num_sanity_val_steps=0) if validate else kwargs.setdefault("limit_val_batches", 0)
    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=ModelParallelStrategy(data_parallel_size=devices // tp, tensor_parallel_size=tp) if devices > 1 else "auto",
        plugins=[lf.FP8Precision(recipe=recipe)],
        max_epochs=epochs,
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[record, *callbacks],
        default_root_dir=out_dir,
        use_distributed_sampler=False,  # the model's train_dataloader shards the data itself
        **kwargs,
    )


def fresh(seed, **kwargs):
    torch.manual_seed(seed)
    return ShardedDecoder(**kwargs)


def full_state(module):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not dist.is_initialized():
        return {k: v.detach().clone() for k, v in module.state_dict().items()}
    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def single_process(recipe, mode):
    return mode == "single"


def main(out_dir, recipe, mode):
    if mode == "single":
        record = Record()
        model = fresh(0)
        trainer(out_dir, recipe, 2, record, 1, validate=True).fit(model)
        torch.save(
            {"losses": record.losses, "val_losses": record.val_losses, "state": full_state(model), "fp8": lf.fp8_state_dict(model)},
            os.path.join(out_dir, "single.pt"),
        )
    elif mode == "tp":
        record = Record()
        model = fresh(0)
        trainer(out_dir, recipe, 2, record, 2, tp=2).fit(model)
        state = full_state(model)
        layers = {n: m.weight for n, m in model.named_modules() if isinstance(m, lf.FP8Linear)}
        kinds = {n: (type(w._local_tensor).__name__, [str(p) for p in w.placements]) for n, w in layers.items()}
        if dist.get_rank() == 0:
            torch.save({"losses": record.losses, "state": state, "fp8": lf.fp8_state_dict(model), "weights": kinds}, os.path.join(out_dir, "tp.pt"))
    elif mode == "errors":
        import warnings

        result = {}
        try:
            trainer(out_dir, recipe, 1, Record(), 2, limit_train_batches=1).fit(fresh(0, prepare=False))
        except ValueError as error:
            result["unprepared"] = str(error)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            record = Record()
            trainer(out_dir, recipe, 1, record, 2, tp=2, limit_train_batches=2).fit(fresh(0, torch_styles=True))
        result["torch_styles_warnings"] = [str(w.message) for w in caught if "lightning_fp8" in str(w.message)]
        result["torch_styles_losses"] = record.losses
        if dist.get_rank() == 0:
            torch.save(result, os.path.join(out_dir, "errors.pt"))
    elif mode == "compiled":
        from torch._dynamo.testing import CompileCounterWithBackend

        backend = CompileCounterWithBackend("aot_eager")
        result = {}
        for name, compiled in (("eager", False), ("compiled", True)):
            record = Record()
            model = fresh(0, compile_backend=backend if compiled else None)
            trainer(out_dir, recipe, 2, record, 2, accumulate_grad_batches=2).fit(model)
            result[name] = {"losses": record.losses, "fp8": lf.fp8_state_dict(model)}
        result["graphs"] = backend.frame_count
        if dist.get_rank() == 0:
            torch.save(result, os.path.join(out_dir, "compiled.pt"))
    elif mode == "bytes":
        gathered = {}
        for fp8_all_gather in (True, False):
            record = Record()
            model = fresh(0, fp8_all_gather=fp8_all_gather, param_dtype=torch.bfloat16)
            trainer(out_dir, recipe, 1, record, 2, limit_train_batches=2).fit(model)
            gathered["fp8" if fp8_all_gather else "bf16"] = record.gathered
        if dist.get_rank() == 0:
            torch.save(gathered, os.path.join(out_dir, "bytes.pt"))
    else:
        record = Record()
        straight = fresh(0)
        csv = CSVLogger(out_dir, name="", version="")
        t = trainer(out_dir, recipe, 2, record, 2, logger=csv, callbacks=[lf.FP8StatsCallback(log_every_n_steps=1, summary=False)], log_every_n_steps=1, validate=True)
        t.fit(straight)
        rank = t.global_rank
        # the local shard (the LM head, owned by the root, is held unsharded after the last validation forward)
        weights = {n: type(lf.distributed.fp8_all_gather_shard(m)).__name__ for n, m in straight.named_modules() if isinstance(m, lf.FP8Linear)}
        torch.save(lf.fp8_state_dict(straight), os.path.join(out_dir, f"fp8_rank{rank}.pt"))
        state = full_state(straight)

        first = fresh(0)
        t = trainer(out_dir, recipe, 1, Record(), 2, validate=True)
        t.fit(first)
        ckpt = os.path.join(out_dir, "epoch1.ckpt")
        t.save_checkpoint(ckpt)  # a folder: torch.distributed.checkpoint shards + Lightning's metadata file
        first_state = full_state(first)

        resumed = fresh(1)  # another init: everything must come from the checkpoint
        t = trainer(out_dir, recipe, 2, Record(), 2, validate=True)
        t.fit(resumed, ckpt_path=ckpt)
        resumed_state = full_state(resumed)

        # the same folder into another split: tensor parallel 2 x data parallel 1
        start, tp_record = AtTrainStart(), Record()
        tp_resumed = fresh(1)
        trainer(out_dir, recipe, 2, tp_record, 2, tp=2, callbacks=[start]).fit(tp_resumed, ckpt_path=ckpt)
        tp_state = full_state(tp_resumed)
        if rank == 0:
            torch.save(
                {
                    "losses": record.losses,
                    "val_losses": record.val_losses,
                    "gathered": record.gathered,
                    "weight_types": weights,
                    "state": state,
                    "resumed": resumed_state,
                    "fp8": lf.fp8_state_dict(straight),
                    "fp8_resumed": lf.fp8_state_dict(resumed),
                    "first": first_state,
                    "fp8_first": lf.fp8_state_dict(first),
                    "tp_resumed_start": start.fp8,
                    "tp_resumed_losses": tp_record.losses,
                    "tp_resumed": tp_state,
                },
                os.path.join(out_dir, "fsdp2.pt"),
            )


if __name__ == "__main__":
    main(*sys.argv[1:])
