"""Run by tests/test_checkpoint.py: exact resume of FP8 training under DDP, 2 CPU processes on gloo.

Three fits in one launch: 2 epochs straight; 1 epoch + checkpoint; resume for the second epoch.
Rank 0 saves the final weights and FP8 states of both routes to OUT_DIR; every rank saves its own
FP8 state after the straight run so the test can check the ranks agree. An FP8StatsCallback logs every
third step (of 4) in all three fits (to a CSVLogger in the straight and the resumed one), and ModelCheckpoint writes the checkpoint at the end of the
first epoch (step 2), inside a logging interval: the resumed run's whole-run counts and its logged metrics must
equal the straight run's (each rank restarts its counters at the resume instead of loading the saving rank's, and
the counts of steps 1-2, not yet logged when the checkpoint was written, come from the callback's state).

Usage: ddp_resume.py OUT_DIR RECIPE, or ``main(OUT_DIR, RECIPE)`` from tests/scripts/gloo_checks.py.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from models import TinyDecoder, loader  # noqa: E402

import lightning_fp8 as lf  # noqa: E402

N_DATA = 32 * 32 + 1  # 32 windows: 2 batches of 8 per rank per epoch


LOG_EVERY = 3  # logs at step 3 of 4; the checkpoint of step 2 falls inside the interval


def trainer(out_dir, recipe, epochs, callbacks, logger=False):
    return L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        plugins=[lf.FP8Precision(recipe=recipe)],
        max_epochs=epochs,
        logger=logger,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=out_dir,  # the stats callback saves its heatmap there
    )


def fresh(seed):
    torch.manual_seed(seed)
    return TinyDecoder()


def main(out_dir, recipe):
    stats_straight = lf.FP8StatsCallback(log_every_n_steps=LOG_EVERY, summary=False)
    straight = fresh(0)
    t = trainer(out_dir, recipe, 2, [stats_straight], CSVLogger(out_dir, name="straight", version=0))
    t.fit(straight, loader(n=N_DATA))
    torch.save(lf.fp8_state_dict(straight), os.path.join(out_dir, f"fp8_rank{t.global_rank}.pt"))

    first = fresh(0)
    saver = ModelCheckpoint(dirpath=out_dir, filename="epoch1", save_on_train_epoch_end=True)
    t = trainer(out_dir, recipe, 1, [lf.FP8StatsCallback(log_every_n_steps=LOG_EVERY, summary=False), saver])
    t.fit(first, loader(n=N_DATA))
    ckpt = os.path.join(out_dir, "epoch1.ckpt")

    stats_resumed = lf.FP8StatsCallback(log_every_n_steps=LOG_EVERY, summary=False)
    resumed = fresh(1)  # different init: everything must come from the checkpoint
    t = trainer(out_dir, recipe, 2, [stats_resumed], CSVLogger(out_dir, name="resumed", version=0))
    t.fit(resumed, loader(n=N_DATA), ckpt_path=ckpt)

    if t.global_rank == 0:
        torch.save(
            {
                "straight": {k: v.detach().clone() for k, v in straight.state_dict().items()},
                "resumed": {k: v.detach().clone() for k, v in resumed.state_dict().items()},
                "fp8_straight": lf.fp8_state_dict(straight),
                "fp8_resumed": lf.fp8_state_dict(resumed),
                "totals_straight": stats_straight._stats.total_counts,
                "totals_resumed": stats_resumed._stats.total_counts,
            },
            os.path.join(out_dir, "result.pt"),
        )


if __name__ == "__main__":
    main(*sys.argv[1:])
