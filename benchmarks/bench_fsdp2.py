"""FSDP2 all-gather: bytes moved per training step by FSDP2's collectives, FP8 all-gather against bf16, in one run.

A small GPT (``tests/models.py``'s TinyDecoder at hidden 128: its Linear weights are most of the parameters) trains a
few steps through a real Lightning ``Trainer`` with ``ModelParallelStrategy(data_parallel_size=2)``: 2 processes (on a
CPU: gloo), FSDP2 on every block and the root, ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` for every
parameter that is not gathered in FP8. Configurations:

* ``bf16``: ``precision="bf16-mixed"``, no FP8: the baseline;
* ``tensorwise-bf16-gather``: ``FP8Precision(recipe="tensorwise")``, ``prepare_for_sharding(fp8_all_gather=False)``:
  FP8 compute, bf16 all-gather;
* ``tensorwise`` / ``delayed``: FP8 all-gather (``prepare_for_sharding``);
* ``rowwise``: gathers in bf16 (row-scaled weights are not gathered in FP8, see docs/distributed.md);
* ``torchao-tensorwise``: torchao's ``convert_to_float8_training`` with ``enable_fsdp_float8_all_gather=True`` (its
  ``emulate=True`` path on a CPU) and ``precompute_float8_dynamic_scale_for_fsdp`` after each optimizer step.

Per configuration: the bytes FSDP2 hands to ``all_gather_single`` (parameter all-gathers, forward and backward) and to
``reduce_scatter_single`` (gradients) per training step (before torch 2.13: ``all_gather_into_tensor`` and
``reduce_scatter_tensor``), counted by wrapping those two functions (FSDP2's default collectives call them by name
at each call), the ratios to ``bf16`` and to ``tensorwise-bf16-gather``, the last loss
(sanity) and the median step time (on a CPU: emulated FP8 and gloo, not a speed measurement).

Each configuration runs in its own launch of this script (``--worker NAME``; Lightning starts rank 1 by running the
same command line again); the parent collects the workers' files into ``benchmarks/results/fsdp2.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

CONFIGS = ["bf16", "tensorwise-bf16-gather", "tensorwise", "delayed", "rowwise", "torchao-tensorwise"]
DIM, STEPS, BATCH = 128, 6, 4  # per rank: 4 windows of 32 bytes


def worker(name: str, out: str) -> None:
    """One configuration, 2 processes; rank 0 writes ``out``."""
    import lightning as L
    import torch
    import torch.distributed as dist
    from lightning.pytorch.strategies import ModelParallelStrategy
    from models import TinyDecoder, loader
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    import lightning_fp8 as lf

    counted = {"all_gather": 0, "reduce_scatter": 0}
    # the names FSDP2 calls the two collectives by, from torch 2.13 and before it
    names = {"all_gather": "all_gather_single", "reduce_scatter": "reduce_scatter_single"}
    if not hasattr(dist, "all_gather_single"):
        names = {"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor"}
    real = {kind: getattr(dist, name) for kind, name in names.items()}

    def counting(kind):
        def collective(output, input, *args, **kwargs):
            counted[kind] += input.numel() * input.element_size()
            return real[kind](output, input, *args, **kwargs)

        return collective

    for kind, name in names.items():
        setattr(dist, name, counting(kind))
    torchao = name.startswith("torchao")
    recipe = name.split("-")[0]

    class GPT(TinyDecoder):
        def configure_model(self):
            if isinstance(self, FSDPModule):
                return
            if torchao:
                from torchao.float8 import Float8LinearConfig, convert_to_float8_training

                config = Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True)
                convert_to_float8_training(self, config=config, module_filter_fn=lambda m, fqn: fqn != "")
            elif name != "bf16":
                lf.prepare_for_sharding(self, fp8_all_gather=not name.endswith("bf16-gather"))
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
            for block in self.blocks:
                fully_shard(block, mesh=self.device_mesh["data_parallel"], mp_policy=policy)
            fully_shard(self, mesh=self.device_mesh["data_parallel"], mp_policy=policy)

    class Measure(L.Callback):
        def __init__(self):
            self.steps, self.times, self.loss = [], [], float("nan")

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            counted.update(all_gather=0, reduce_scatter=0)
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.times.append(time.perf_counter() - self.start)
            self.steps.append(dict(counted))
            self.loss = outputs["loss"].item()

    class AfterStep(L.Callback):  # torchao's scales for its FP8 all-gather, once per optimizer step
        def on_before_zero_grad(self, trainer, pl_module, optimizer):
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(pl_module)

    torch.manual_seed(0)
    model = GPT(dim=DIM, heads=4, layers=2)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    total = sum(p.numel() for p in model.parameters())
    measure = Measure()
    plugins = {} if name == "bf16" or torchao else {"plugins": [lf.FP8Precision(recipe=recipe)]}
    precision = {"precision": "bf16-mixed"} if not plugins else {}
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[measure, *([AfterStep()] if torchao else [])],
        **plugins,
        **precision,
    )
    trainer.fit(model, loader(n=32 * BATCH * 2 * STEPS + 1, batch_size=BATCH))
    if trainer.global_rank == 0:
        with open(out, "w") as f:
            json.dump(
                {
                    "steps": measure.steps,
                    "step_s": statistics.median(measure.times[1:]),
                    "loss": measure.loss,
                    "linear_weight_fraction": linear / total,
                    "parameters": total,
                },
                f,
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=os.path.join(HERE, "results", "fsdp2.json"), help="result file")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of: {', '.join(CONFIGS)}")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.out)
        return 0

    from harness import environment, write_result

    env = environment("cpu")
    started = time.perf_counter()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.configs.split(","):
            out = os.path.join(tmp, "result.json")
            command = [sys.executable, os.path.abspath(__file__), "--worker", name, "--out", out]
            proc = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            if proc.returncode != 0 or not os.path.exists(out):
                lines = [line for line in proc.stderr.splitlines() if "Error" in line]
                results[name] = {"status": "not measured", "reason": (lines[-1] if lines else proc.stderr[-300:]).strip()}
                print(f"{name}: not measured ({results[name]['reason']})")
                continue
            with open(out) as f:
                result = json.load(f)
            os.remove(out)
            steady = result["steps"][1:]  # the first step allocates; every later step moves the same bytes
            result.update(
                status="measured",
                all_gather_bytes=statistics.median(s["all_gather"] for s in steady),
                reduce_scatter_bytes=statistics.median(s["reduce_scatter"] for s in steady),
            )
            results[name] = result
            print(f"{name}: all-gather {result['all_gather_bytes']:.0f} B/step, reduce-scatter "
                  f"{result['reduce_scatter_bytes']:.0f} B/step, loss {result['loss']:.4f}")
    command = "python benchmarks/bench_fsdp2.py" + ("" if args.configs == ",".join(CONFIGS) else f" --configs {args.configs}")
    write_result(
        args.json,
        env,
        command,
        model={"hidden": DIM, "blocks": 2, "heads": 4, "tokens_per_rank_per_step": BATCH * 32, "ranks": 2, "steps": STEPS},
        configs=results,
        total_s=time.perf_counter() - started,
    )
    print(f"written to {args.json}; render the docs tables with python benchmarks/docs_tables.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
