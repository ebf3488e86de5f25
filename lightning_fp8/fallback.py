"""FP8FallbackCallback: switch a layer that keeps overflowing in FP8 to high precision, for the rest of the run.

Opt-in: ``Trainer(plugins=[FP8Precision(recipe="delayed")], callbacks=[FP8FallbackCallback()])``.

Every ``every_n_steps`` optimizer steps (default: the Trainer's ``log_every_n_steps``) the callback takes one
reading through its own :class:`~lightning_fp8.FP8Stats` (one device snapshot, one cross-rank reduction, one host
copy; its own interval baseline, taken at the start of training); on every other step it does nothing (no transfer,
no sync). A layer is *bad* in a reading when the overflow fraction of any of its tensors (input, weight,
grad_output) in the interval is above ``overflow_threshold``, or (with ``nonfinite``) when one of its most recent
amaxes is NaN or Inf. A layer bad in ``patience`` consecutive readings is switched by the plugin
(:meth:`~lightning_fp8.fabric.FP8PrecisionBase.keep_in_high_precision`): before the next forward it turns back into
its high-precision type (same Parameters, so the optimizer and DDP are unaffected), and from then on it computes
exactly like ``nn.Linear`` under the plugin's ``torch.autocast``. Its row stays in the model's state table, unused;
it is no longer read, rolled into statistics or exported in checkpoints (``fp8_state_dict`` lists FP8 layers only),
and the plugin's conversion report lists it as skipped, with the reason.

**Where the switched layers live.** The plugin remembers them, next to its ``exclude``: every later conversion of the
model (``trainer.validate``, ``test`` and ``predict`` convert it again) keeps them in high precision, and the
plugin's checkpoint state carries them, so a run resumed from a checkpoint, or an evaluation from one (with or
without this callback), switches them again before the first batch. The callback's own ``state_dict`` holds when
and why each layer was switched (for the summary and the ``exclude`` advice) and its patience counters. A checkpoint
written before the plugin kept the names (only the callback's state lists them) is read through the callback, at
``on_load_checkpoint``.

**Why before the next forward.** ``FP8StatsCallback`` reads at the end of the same steps; switched at once, a layer
would vanish from the statistics of the interval that made it switch whenever the fallback ran first. Switched before
the next forward (or at a checkpoint save, or at the end of fit, if those come first), the layer is read by every
callback at the end of that step, whatever the callbacks' order.

Every switch is a loud warning (layer, reason, observed value, global step). At the end of fit the list is printed
with the ``exclude`` list to use next time: ``FP8Precision(exclude=[...])``.

Under DDP the readings are reduced across ranks inside :class:`~lightning_fp8.FP8Stats`: every rank reads on the
same steps (the readings are collectives), sees the same values and switches the same layers at the same step, even
when only one rank's data overflows.

Why a callback of our own: neither torchao nor Transformer Engine watches FP8 health during training; their only
remedy is a static list of layers kept in high precision, which is what this callback writes out at the end.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.callbacks import Callback
from torch import nn

from lightning_fp8.callbacks import stats_source
from lightning_fp8.convert import convert_from_fp8
from lightning_fp8.fabric import FP8PrecisionBase
from lightning_fp8.module import FP8Module
from lightning_fp8.recipe import ROLES
from lightning_fp8.stats import SWITCHED_BY_FALLBACK, FP8Stats, LayerReading

TROUBLESHOOTING = "docs/troubleshooting.md"


class FP8FallbackCallback(Callback):
    """Switch FP8 layers that keep overflowing (or see NaN / Inf) to high precision for the rest of the run.

    Args:
        overflow_threshold: a layer is bad in a reading when the overflow fraction of any of its tensors in the
            interval since the previous reading is above this value (in ``[0, 1)``).
        nonfinite: a layer is also bad when one of its most recent amaxes is NaN or Inf.
        patience: consecutive bad readings before the layer is switched (``>= 1``): readings with a non-finite amax,
            or readings with an overflow fraction above the threshold (two streaks). For the overflow streak a reading
            whose interval counted nothing for the layer (``statistics_every_n_steps``, or the layer did not run) is
            skipped: it neither clears nor extends it. The amaxes are recorded on every step: every reading clears or
            extends the non-finite streak.
        every_n_steps: read every this many optimizer steps; ``None`` (default) follows the Trainer's
            ``log_every_n_steps``.

    Attributes:
        fallen_back: ``{layer name: {"step", "reason", "value"}}`` of the switched layers, in order (restored from
            checkpoints). The plugin's ``high_precision_layers`` is what keeps them in high precision.

    Raises:
        ValueError: for invalid settings, naming the field.
    """

    def __init__(
        self,
        overflow_threshold: float = 0.01,
        nonfinite: bool = True,
        patience: int = 3,
        every_n_steps: int | None = None,
    ) -> None:
        if isinstance(overflow_threshold, bool) or not isinstance(overflow_threshold, (int, float)) or not (
            0 <= overflow_threshold < 1
        ):
            raise ValueError(f"overflow_threshold must be a number in [0, 1), got {overflow_threshold!r}")
        if not isinstance(nonfinite, bool):
            raise ValueError(f"nonfinite must be True or False, got {nonfinite!r}")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(f"patience must be an int >= 1, got {patience!r}")
        if every_n_steps is not None and (
            isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1
        ):
            raise ValueError(f"every_n_steps must be None or an int >= 1, got {every_n_steps!r}")
        self.overflow_threshold = float(overflow_threshold)
        self.nonfinite = nonfinite
        self.patience = patience
        self.every_n_steps = every_n_steps
        self.fallen_back: dict[str, dict[str, Any]] = {}
        self.readings = 0  #: readings taken in this process
        self._stats = FP8Stats(None)
        self._bad: dict[str, int] = {}  # consecutive readings with an overflow fraction above the threshold, per layer
        self._bad_nonfinite: dict[str, int] = {}  # consecutive readings with a non-finite amax, per layer
        self._last_read_step = -1
        self._missing_warned: set[str] = set()
        self._restored: list[str] = []  # layers of a loaded state, reported at the start of training

    @property
    def fetches(self) -> int:
        """Batched device-to-host copies made (one per reading, plus the baseline at the start of training)."""
        return self._stats.fetches

    @property
    def exclude(self) -> list[str]:
        """The names of the switched layers: the ``exclude`` list for ``FP8Precision`` next time (a name the model no
        longer has is left out: as a pattern it would match nothing, which is an error at setup)."""
        return [name for name in self.fallen_back if name not in self._missing_warned]

    # ------------------------------------------------------------------ helpers
    def _every(self, trainer: pl.Trainer) -> int:
        return self.every_n_steps or max(1, trainer.log_every_n_steps or 1)

    def _modules(self) -> dict[str, nn.Module]:
        """Every module of the source's models, by the name FP8Stats gives it (prefix + qualified name)."""
        models = self._stats._models()
        modules: dict[str, nn.Module] = {}
        for prefix, model in zip(self._stats._prefixes(models), models):
            for name, module in model.named_modules():
                modules.setdefault(prefix + (name or type(module).__name__), module)
        return modules

    def _switch(self, trainer: pl.Trainer, module: nn.Module, reason: str, now: bool = False) -> None:
        """Ask the plugin to switch one FP8 layer to high precision and keep it there (before the next forward, or
        ``now``). Without an FP8 plugin (a model converted by hand) the layer is turned back at once."""
        plugin = trainer.precision_plugin
        if isinstance(plugin, FP8PrecisionBase):
            for model in plugin.fp8_models:
                local = next((n for n, m in model.named_modules() if m is module), None)
                if local is not None:
                    reason = f"{SWITCHED_BY_FALLBACK}: {reason}"
                    plugin.keep_in_high_precision(local, reason, before_next_forward=not now)
                    return
        convert_from_fp8(module)

    # ------------------------------------------------------------------ hooks
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """A checkpoint written before the plugin kept the switched layers lists them in this callback's state only:
        hand them to the plugin now, before the model is converted and the plugin's FP8 state restored (which holds no
        state for them), so that fit, validate, test and predict from it keep them in high precision."""
        plugin = trainer.precision_plugin
        if not isinstance(plugin, FP8PrecisionBase):
            return
        plugin_state = checkpoint.get(type(plugin).__qualname__)
        if not isinstance(plugin_state, dict) or "high_precision_layers" in plugin_state:
            return
        own = (checkpoint.get("callbacks") or {}).get(self.state_key) or {}
        for name, info in own.get("fallen_back", {}).items():
            plugin.keep_in_high_precision(name, f"{SWITCHED_BY_FALLBACK}: {info['reason']}")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The plugin has restored its state by now: report the layers of a loaded state, then take the baseline."""
        self._stats.source = stats_source(trainer, pl_module)
        self._report_restored(trainer)
        if not self._stats.has_baseline:
            self._stats.take_baseline()  # before the first step: one host copy

    def _report_restored(self, trainer: pl.Trainer) -> None:
        restored, self._restored = self._restored, []
        if not restored:
            return
        modules = self._modules()
        for name in restored:
            if name not in modules:
                self._missing_warned.add(name)  # left out of the exclude advice
                rank_zero_warn(
                    f"FP8FallbackCallback: the checkpoint lists layer {name!r} as switched to high precision, but the "
                    "model has no such module; nothing to switch."
                )
        for name in restored:
            info, module = self.fallen_back[name], modules.get(name)
            if module is None:
                continue
            if isinstance(module, FP8Module):  # a state loaded without the plugin's (by hand, or no FP8Precision)
                self._switch(trainer, module, info["reason"], now=True)
            rank_zero_warn(
                f"FP8FallbackCallback: layer {name!r} runs in high precision for this run, as in the run this "
                f"checkpoint comes from (switched at global step {info['step']}: {info['reason']}). Next time use "
                f"FP8Precision(exclude={self.exclude!r})."
            )

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Every rank gets here on the same steps (global_step is the same everywhere): the reading is a collective.
        step = trainer.global_step
        if step == 0 or step == self._last_read_step or step % self._every(trainer) != 0:
            return
        self._last_read_step = step
        self.check_now(trainer, pl_module)

    def check_now(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> list[str]:
        """Take one reading (on every rank) and have the plugin switch the layers bad for ``patience`` readings (before
        the next forward); returns their names."""
        self._stats.source = stats_source(trainer, pl_module)
        reading = self._stats.read()
        if reading is None:
            return []
        metrics = self._stats.metrics(reading)
        self.readings += 1
        modules = None
        switched = []
        for name, layer in reading.layers.items():
            why = self._why_bad(name, layer, metrics)
            if why is None:
                continue
            reason, value, streak = why
            if streak < self.patience:
                continue
            modules = self._modules() if modules is None else modules
            module = modules.get(name)
            if not isinstance(module, FP8Module):
                continue
            reason = f"{reason} in {streak} consecutive readings (every {self._every(trainer)} steps)"
            self.fallen_back[name] = {"step": trainer.global_step, "reason": reason, "value": value}
            self._bad.pop(name, None)
            self._bad_nonfinite.pop(name, None)
            self._switch(trainer, module, reason)
            switched.append(name)
            rank_zero_warn(
                f"FP8FallbackCallback: layer {name!r} switched to high precision for the rest of the run at global step "
                f"{trainer.global_step}: {reason}. It now computes like its high-precision type under the plugin's "
                f"autocast. Next time use FP8Precision(exclude={self.exclude!r}). See {TROUBLESHOOTING}#overflows."
            )
        return switched

    def _why_bad(self, name: str, layer: LayerReading, metrics: dict[str, float]) -> tuple[str, float, int] | None:
        """Update ``name``'s two streaks with this reading; ``(reason, value, streak)`` when it is bad.

        The non-finite streak (``nonfinite``) follows every reading: the amaxes are recorded on every step. The
        overflow streak follows the readings that counted for the layer: a reading whose interval counted nothing
        (``statistics_every_n_steps``, or the layer did not run) has no overflow fraction and neither clears nor
        extends it."""
        nonfinite = None
        if self.nonfinite:
            for r, role in enumerate(ROLES):
                amax = layer.history[r][0]
                if not math.isfinite(amax):
                    nonfinite = (f"non-finite {role} amax ({amax})", amax)
                    break
            self._bad_nonfinite[name] = self._bad_nonfinite.get(name, 0) + 1 if nonfinite else 0
        worst, counted = None, False
        for role in ROLES:
            frac = metrics.get(f"fp8/{name}/{role}/overflow_frac")
            counted = counted or frac is not None
            if frac is not None and frac > self.overflow_threshold and (worst is None or frac > worst[1]):
                worst = (role, frac)
        if counted:
            self._bad[name] = self._bad.get(name, 0) + 1 if worst else 0
        if nonfinite is not None and (worst is None or self._bad_nonfinite[name] >= self._bad.get(name, 0)):
            return nonfinite[0], nonfinite[1], self._bad_nonfinite[name]
        if worst is None:
            return None
        role, frac = worst
        reason = f"{role} overflow fraction {frac:.2%} above overflow_threshold={self.overflow_threshold:g}"
        return reason, frac, self._bad[name]

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.fallen_back:
            rank_zero_warn(self.summary())

    def summary(self) -> str:
        """The switched layers, with step and reason, and the ``exclude`` list for next time."""
        lines = [f"FP8FallbackCallback: {len(self.fallen_back)} layer(s) ran in high precision after a fallback:"]
        for name, info in self.fallen_back.items():
            lines.append(f"  {name}: at global step {info['step']}, {info['reason']}")
        lines.append(f"Next time, keep them in high precision from the start: FP8Precision(exclude={self.exclude!r})")
        return "\n".join(lines)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {
            "fallen_back": {name: dict(info) for name, info in self.fallen_back.items()},
            "bad": dict(self._bad),
            "bad_nonfinite": dict(self._bad_nonfinite),
            "last_read_step": self._last_read_step,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.fallen_back = {name: dict(info) for name, info in state_dict["fallen_back"].items()}
        self._restored = list(self.fallen_back)
        self._bad = dict(state_dict.get("bad", {}))
        self._bad_nonfinite = dict(state_dict.get("bad_nonfinite", {}))
        self._last_read_step = state_dict.get("last_read_step", -1)
