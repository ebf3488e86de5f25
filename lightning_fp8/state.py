"""The FP8 state table: every FP8 layer's scales, amax histories and counters in a few flat device tensors.

One :class:`FP8StateTable` holds the state of all FP8 layers of a model that share a recipe (the
plugin and :func:`~lightning_fp8.convert_to_fp8` bind a model's layers into one table per recipe; a
layer built on its own has a private table of one row until then). Each layer holds the table and its
row index. For row ``i`` and role ``r`` (``input``, ``weight``, ``grad_output``; see
:data:`lightning_fp8.recipe.ROLES`):

==================  ===============  ===================================================================
tensor              shape            meaning
==================  ===============  ===================================================================
``scale``           ``(L, 3)``       scale used by the most recent cast (``fp8 = x * scale``); for
                                     ``delayed`` after a roll: the scale the next cast will use; for
                                     ``rowwise`` the smallest row scale
``amax_history``    ``(L, 3, H)``    ring buffer of the last ``H`` amaxes, index 0 the most recent
``amax_pending``    ``(L, 3)``       running max of the amaxes seen since the last roll (the max over
                                     the micro-batches of an accumulation window)
``counts``          ``(L, 3, 4)``    cumulative ``seen``, ``nonzero``, ``overflow``, ``underflow``
                                     element counts (int64), per rank
``initialized``     ``(L, 3)``       ``delayed``: the history holds a usable amax
``history_scale``   ``(L, 3)``       ``delayed``: the scale derived from the history at the last roll, which
                                     the casts read (not exported: ``scale`` as of the last roll or write
                                     of rows); the input and weight columns, and their ``initialized``
                                     flags, are read from a copy made at each roll (``forward_scale``,
                                     ``forward_ready``, see :meth:`FP8StateTable.publish_forward_history`)
``counts_epoch``    ``(L,)``         bumped whenever the row's counters restart from zero (a reader of
                                     interval statistics then takes a new baseline)
``amax_bins``       ``(L, 3, B)``    cumulative histogram of the slice / block amaxes of ``rowwise`` and the
                                     block recipes over powers of two (``B`` bins, see
                                     :func:`lightning_fp8.quantize.amax_bins`; ``B = 0`` for per-tensor
                                     recipes), per rank, restarted with the counters
==================  ===============  ===================================================================

Every operation on the whole table (:meth:`FP8StateTable.roll`, the loss-scale rescale, the cross-rank
reduction of :mod:`lightning_fp8.distributed`, export and import, the statistics snapshot of
:mod:`lightning_fp8.stats`) is a constant number of batched tensor operations, whatever the number of
layers: on a GPU, a few kernel launches per optimizer step instead of a few per layer. Nothing here
reads a device value on the host.

The table is not made of module buffers: it is not part of the model ``state_dict`` (a checkpoint of a
converted model loads into the plain model), DDP does not broadcast it, and it follows the layers'
device, never their dtype (:meth:`FP8StateTable.follow`). It travels in checkpoints through
:func:`fp8_state_dict` / :func:`load_fp8_state_dict`, as tensors and plain values only (loadable with
``torch.load(weights_only=True)``).

Why our own state: torchao keeps no statistics and removed delayed scaling; Transformer Engine keeps
its state per module in a pickled ``_extra_state`` blob inside the model ``state_dict``. Neither gives
a plain, device-resident, checkpoint-safe record of every cast with per-step cost independent of depth.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_fp8.quantize import N_AMAX_BINS
from lightning_fp8.recipe import FP8_MAX, GRAD_OUTPUT, INPUT, ROLES, FP8Recipe, amax_to_scale

#: Columns of ``counts``.
COUNT_FIELDS: tuple[str, ...] = ("seen", "nonzero", "overflow", "underflow")
SEEN, NONZERO, OVERFLOW, UNDERFLOW = 0, 1, 2, 3

#: The table's tensors, in export order.
STATE_FIELDS: tuple[str, ...] = (
    "scale", "amax_history", "amax_pending", "counts", "initialized", "counts_epoch", "amax_bins"
)
STATE_FORMAT_VERSION = 2

_N_ROLES = len(ROLES)

#: Every live table, so that a standalone region can find the tables that its compiled layers ran with (see
#: ``compiled_forward_marks``).
_LIVE_TABLES: weakref.WeakSet[FP8StateTable] = weakref.WeakSet()
#: Guards additions to ``_LIVE_TABLES`` against a look at it from another thread ("Set changed size during iteration").
_LIVE_TABLES_LOCK = threading.Lock()


def _register(table: FP8StateTable) -> None:
    with _LIVE_TABLES_LOCK:
        _LIVE_TABLES.add(table)


def _live_tables() -> list[FP8StateTable]:
    with _LIVE_TABLES_LOCK:
        return list(_LIVE_TABLES)


def _version_of(tensor: Tensor) -> int | None:
    """``tensor``'s version counter; ``None`` for an inference tensor, which has none."""
    return None if tensor.is_inference() else tensor._version


#: The state that the casts of one role write on the step path; each role's part is a tensor of its own.
_PER_ROLE_FIELDS = ("scale", "amax_pending", "counts", "amax_bins")


def amax_bin_count(recipe: FP8Recipe) -> int:
    """Bins of a table's ``amax_bins``: a histogram for recipes with several scales per tensor, none otherwise."""
    specs = recipe.cast_specs()
    pairs = (specs.forward, specs.grad_input, specs.grad_weight)
    return N_AMAX_BINS if any(spec.granularity != "tensor" for pair in pairs for spec in pair) else 0


class FP8StateTable:
    """The FP8 state of a group of layers sharing one recipe (see the module docstring for the tensors).

    ``scale``, ``amax_pending`` and ``counts`` are stored as one tensor per role and read back stacked
    (read-only copies): the casts of the forward (input, weight) and of the backward (grad_output) then never
    write the same tensor. Under ``torch.compile`` this matters: AOTAutograd saves a forward-time copy of
    any tensor the forward mutates and, when the backward mutates it too, writes that whole copy back,
    which would undo what other graphs (other blocks, a roll) wrote in between.

    Args:
        recipe: the layers' recipe (the history length and the ``delayed`` formula come from it).
        num_layers: number of rows.
        device: where the tensors live (the layers' device).
    """

    def __init__(self, recipe: FP8Recipe, num_layers: int = 1, device: torch.device | str | None = None) -> None:
        self.recipe = recipe
        #: The recipe's cast specs (layers read them here on every forward).
        self.specs = recipe.cast_specs()
        self._fp8_max: Tensor | None = None  # per-role fp8_max, (3,) float64 on the device, built lazily
        #: Bumped (on the host) whenever the weight scales may have changed other than by a cast: each roll, each write of
        #: rows, each move. An FP8 weight cast under one generation of an unchanged weight can be reused.
        self.generation = 0
        #: The precision plugins' ``statistics_every_n_steps``: the optimizer steps that updated this table's layers so
        #: far, and whether the layers' casts count in the current forward (host values, set by the plugin; a layer
        #: reads the flag at forward time, see :func:`lightning_fp8.region.decide`).
        self.statistics_step = 0
        self.count_statistics = True
        self._allocate(num_layers, torch.device(device) if device is not None else torch.device("cpu"))
        _register(self)

    # ------------------------------------------------------------------ storage
    def _allocate(self, num_layers: int, device: torch.device) -> None:
        n, length = num_layers, self.recipe.amax_history_len
        kw: dict[str, Any] = {"device": device}
        self.role_scale = [torch.ones(n, dtype=torch.float32, **kw) for _ in ROLES]
        self.role_amax_pending = [torch.zeros(n, dtype=torch.float32, **kw) for _ in ROLES]
        self.role_counts = [torch.zeros(n, len(COUNT_FIELDS), dtype=torch.int64, **kw) for _ in ROLES]
        bins = amax_bin_count(self.recipe)
        self.role_amax_bins = [torch.zeros(n, bins, dtype=torch.int64, **kw) for _ in ROLES]
        self.amax_history = torch.zeros(n, _N_ROLES, length, dtype=torch.float32, **kw)
        self.initialized = torch.zeros(n, _N_ROLES, dtype=torch.bool, **kw)
        #: What the history-scaled casts read: ``scale`` as the last roll (or write of rows) left it, never written
        #: by a cast. Casts write ``scale`` in place (the scale they used); a compiled activation checkpoint saves
        #: the tensor it reads for its recomputation, and a cast of a later block writing that tensor would fail
        #: autograd's version check in the backward. Written through ``.data`` (see :meth:`roll`); the backward's
        #: grad_output casts read it (they must see a roll that came after their forward).
        self.history_scale = torch.ones(n, _N_ROLES, dtype=torch.float32, **kw)
        self.publish_forward_history()
        self.counts_epoch = torch.zeros(n, dtype=torch.int64, **kw)
        self._new_compiled_forward_mark()
        self._fp8_max = None
        self.generation = getattr(self, "generation", 0) + 1
        #: Host tokens, one per row: rows with equal tokens have equal input-role state (history, pending amax,
        #: scale, readiness), so one cast serves them (see ``input_lineage``). Fresh rows are all equal.
        self.input_lineage: list[int] = [0] * n
        self._lineage_next = getattr(self, "_lineage_next", 1)
        #: Set once something other than the host code that keeps the tokens recorded an input cast (a compiled
        #: graph; see :meth:`lineage`): no row's token is trusted again until rows are written (:meth:`set_rows`
        #: compares their values).
        self.lineage_untrusted = False
        self.mark_lineage()

    def _new_compiled_forward_mark(self) -> None:
        """A new mark tensor on the table's device (allocation, moves), its predecessor's writes carried over into
        ``_compiled_forward_base`` (see :meth:`compiled_forward_count`)."""
        old = self.__dict__.get("compiled_forward_mark")
        base = self.__dict__.get("_compiled_forward_base", 0)
        self._compiled_forward_base = base + ((_version_of(old) or 0) if old is not None else 0)
        #: Bumped in place by every compiled training forward of the table's layers inside a standalone region (see
        #: :meth:`mark_compiled_forward`); only its version counter is read.
        self.compiled_forward_mark = torch.zeros((), dtype=torch.int64, device=self.amax_history.device)

    def compiled_forward_count(self) -> int | None:
        """How many times compiled layers marked this table (:meth:`mark_compiled_forward`) since it was made, copied
        or loaded, moves included; ``None`` for a table made under ``torch.inference_mode()`` (an inference tensor has
        no version counter, and no compiled training forward can write one outside inference mode)."""
        mark = self.__dict__.get("compiled_forward_mark")
        version = _version_of(mark) if mark is not None else None  # (no mark: a table restored without one)
        return None if version is None else self.__dict__.get("_compiled_forward_base", 0) + version

    def mark_compiled_forward(self) -> None:
        """A compiled training forward of one of the table's layers ran inside a standalone region: the region must roll
        the table on exit. Compiled code cannot note the table in the region (a host-side store in a graph is a side
        effect, which dynamo refuses inside an activation checkpoint); it writes this tensor in place instead, which
        bumps its version counter when the graph runs (AOTAutograd writes a graph's mutations back), and the region
        compares versions on exit (``compiled_forward_marks`` and ``tables_marked_since`` in this module). Eager layers
        note their table in the region itself, exactly, per thread."""
        self.compiled_forward_mark.add_(1)

    def publish_forward_history(self) -> None:
        """A new copy of the input and weight roles' history scales and flags (``forward_scale``, ``forward_ready``:
        ``(L, 2)``), which the forward's history-scaled casts read. A new tensor at each roll, never written in place:
        a compiled graph that saved the one it read (an activation checkpoint's recomputation in the backward reads
        the table again) keeps the values its forward cast with, as eager replays the scale its forward captured,
        also where the table rolls between the forward and the backward (two optimizers, a retained graph)."""
        with torch.no_grad():
            self.forward_scale = self.history_scale[:, :GRAD_OUTPUT].clone()
            self.forward_ready = self.initialized[:, :GRAD_OUTPUT].clone()

    @property
    def scale(self) -> Tensor:
        """``(L, 3)`` copy of the scales (see the module docstring)."""
        return torch.stack(self.role_scale, dim=1)

    @property
    def amax_pending(self) -> Tensor:
        """``(L, 3)`` copy of the pending amaxes."""
        return torch.stack(self.role_amax_pending, dim=1)

    @property
    def counts(self) -> Tensor:
        """``(L, 3, 4)`` copy of the element counters."""
        return torch.stack(self.role_counts, dim=1)

    @property
    def amax_bins(self) -> Tensor:
        """``(L, 3, B)`` copy of the slice-amax histograms."""
        return torch.stack(self.role_amax_bins, dim=1)

    @property
    def num_layers(self) -> int:
        """Number of rows (layers)."""
        return self.amax_history.shape[0]

    @property
    def device(self) -> torch.device:
        """The device of the tensors."""
        return self.amax_history.device

    def tensors(self) -> dict[str, Tensor]:
        """The table's tensors by name, in export order (the per-role ones stacked: copies)."""
        return {name: getattr(self, name) for name in STATE_FIELDS}

    def _storage(self) -> list[Tensor]:
        return [
            *self.role_scale,
            *self.role_amax_pending,
            *self.role_counts,
            *self.role_amax_bins,
            self.amax_history,
            self.initialized,
            self.counts_epoch,
            self.history_scale,
            self.forward_scale,
            self.forward_ready,
            self.compiled_forward_mark,
        ]

    def follow(self, fn: Any) -> None:
        """Follow a ``Module._apply`` function (``.to()``, ``.cuda()``, ``to_empty()``...) to its device only.

        ``fn`` is applied to an empty probe tensor to learn where the layers went; the table then moves there
        with its values, keeping its own dtypes (``module.half()`` must not turn a scale into a float16, and
        a float64 scale would break the GEMM contract). Idempotent, so every layer of a shared table may
        call it. Moving off the meta device gives fresh state (the values were never initialised).
        """
        target = fn(torch.empty(0, dtype=torch.float32, device=self.device)).device
        if target == self.device:
            return
        if self.device.type == "meta":
            self._allocate(self.num_layers, target)
            return
        trusted = self.lineage() is not None
        for name in ("role_scale", "role_amax_pending", "role_counts", "role_amax_bins"):
            setattr(self, name, [t.to(target) for t in getattr(self, name)])
        for name in ("amax_history", "initialized", "counts_epoch", "history_scale"):
            setattr(self, name, getattr(self, name).to(target))
        self._new_compiled_forward_mark()
        self.publish_forward_history()
        if trusted:  # the same values in new tensors: the tokens still hold
            self.mark_lineage()
        self._fp8_max = None
        self.generation += 1

    def set_rows(self, name: str, index: Tensor, values: Tensor) -> None:
        """Write ``values`` (rows of the exported ``name`` field) into rows ``index`` (a device index tensor).

        Not on the step path (loading, binding, calibration): the rows' input lineage is derived again from the
        values, with one copy to the host."""
        values = values.to(self.device)
        self.generation += 1
        with torch.no_grad():
            if name in _PER_ROLE_FIELDS:
                for role, tensor in enumerate(getattr(self, "role_" + name)):
                    tensor.data.index_copy_(0, index, values[:, role])
            else:
                getattr(self, name).data.index_copy_(0, index, values)
            if name == "scale":
                self.history_scale.data.index_copy_(0, index, values)
        if name in ("scale", "initialized"):
            self.publish_forward_history()
        if name in ("scale", "amax_pending", "amax_history", "initialized"):
            self._derive_input_lineage()

    # ------------------------------------------------------------------ input lineage (host)
    def lineage(self) -> list[int] | None:
        """The rows' input lineage tokens, or ``None`` while they are not trusted (see ``lineage_untrusted``).

        Tokens are host values kept next to the device state: two rows with the same token have recorded the same
        input amaxes since their values were last equal (a shared cast records into both), so their input scales are
        equal without reading the device. A table unpickled from an older version has none: untrusted.

        The eager layers update the tokens with each input cast they record and then :meth:`mark_lineage`. Every
        record of an input cast writes the input role's pending amax in place, which bumps that tensor's version
        counter, whoever records: a compiled graph too (AOTAutograd writes a graph's mutations back into the
        tensor, activation checkpoints and inference mode included). So a version other than the marked one means
        a record the tokens did not follow, and they stay untrusted from then on. The roll and the other writes of
        whole-table state go through ``.data`` (no version bump) and keep equal rows equal. Nothing is stored while
        compiling: a host-side store in a compiled graph is a side effect that dynamo refuses inside an activation
        checkpoint."""
        if self.__dict__.get("lineage_untrusted", True) or "input_lineage" not in self.__dict__:
            return None
        version = self._pending_version()
        if version is None or version != self.__dict__.get("_lineage_version"):
            self.lineage_untrusted = True
            return None
        return self.input_lineage

    def mark_lineage(self) -> None:
        """The tokens follow every input cast recorded so far: remember the input role's pending amax's version."""
        self._lineage_version = self._pending_version()

    def _pending_version(self) -> int | None:
        """The input role's pending amax's version counter; ``None`` for an inference tensor (a table made under
        ``torch.inference_mode()``, which has none: its tokens are never trusted)."""
        return _version_of(self.role_amax_pending[INPUT])

    def __getstate__(self) -> dict[str, Any]:
        """A copy or pickle keeps the tokens' trust (its tensors have version counters of their own)."""
        state = self.__dict__.copy()
        state["lineage_untrusted"] = self.lineage() is None
        state.pop("_lineage_version", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        _register(self)
        if "history_scale" not in state and "role_scale" in state:  # pickled by an older version
            self.history_scale = self.scale.clone()
        if "forward_scale" not in state and "role_scale" in state:
            self.publish_forward_history()
        if "amax_history" in state:  # a copy or a load starts with no compiled forwards (copying bumps the version)
            self.__dict__.pop("compiled_forward_mark", None)
            self._compiled_forward_base = 0
            self._new_compiled_forward_mark()
        if "lineage_untrusted" in state and not state["lineage_untrusted"]:
            self.mark_lineage()

    def new_lineage(self) -> int:
        """A token no row holds: the input-role state of a row that recorded a cast of its own."""
        token = self._lineage_next
        self._lineage_next += 1
        return token

    def _derive_input_lineage(self) -> None:
        """Give rows whose input-role state is equal, value for value, the same token (a host copy of those rows)."""
        self.lineage_untrusted = False
        self.mark_lineage()
        if self.device.type == "meta":
            return
        role = INPUT
        rows = torch.cat(
            [
                self.role_scale[role].unsqueeze(1),
                self.role_amax_pending[role].unsqueeze(1),
                self.amax_history[:, role],
                self.initialized[:, role].unsqueeze(1).float(),
            ],
            dim=1,
        ).cpu()
        tokens: dict[bytes, int] = {}
        for row, values in enumerate(rows):
            key = values.numpy().tobytes()  # bit patterns: NaN rows compare equal to themselves
            if key not in tokens:
                tokens[key] = self.new_lineage()
            self.input_lineage[row] = tokens[key]

    @staticmethod
    def at_row(tensor: Tensor, index: int | Tensor) -> Tensor:
        """Row ``index`` of ``tensor``: a view for an int, a copy for a one-element index tensor
        (``FP8StateRef.row``)."""
        if isinstance(index, Tensor):
            return tensor.index_select(0, index).squeeze(0)
        return tensor[index]

    def _role_max(self) -> Tensor:
        if self._fp8_max is None or self._fp8_max.device != self.device:
            values = [FP8_MAX[self.recipe.dtype(role)] for role in range(_N_ROLES)]
            self._fp8_max = torch.tensor(values, dtype=torch.float64, device=self.device)
        return self._fp8_max

    # ------------------------------------------------------------------ the step path
    @torch.no_grad()
    def record(
        self,
        index: int | Tensor,
        role: int,
        amax: Tensor,
        scale: Tensor,
        numel: int,
        counts: Tensor | None,
        bins: Tensor | None = None,
    ) -> None:
        """Record one cast of ``role`` of layer ``index``: the scale it used, its amax (max-combined into the
        pending amax, NaN-propagating), ``numel`` plus the ``[nonzero, overflow, underflow]`` counts, and the
        histogram of its slice amaxes (``bins``, for tables that keep one). ``counts=None``: a cast that did not
        count (see ``quantize(counters=False)``) records its scale and amax only: ``numel`` and ``bins`` are left out
        too, so that the counters stay the sums over the casts that counted.

        ``index`` is the row: an int (eager: writes through views), or a one-element int64 tensor
        (``FP8StateRef.row``, compiled code: the same values through ``index_put_``)."""
        if isinstance(index, Tensor):
            self._record_at(index, role, amax, scale, numel, counts, bins)
            return
        self.role_scale[role][index].copy_(scale)
        pending = self.role_amax_pending[role][index]
        pending.copy_(torch.maximum(pending, amax.float()))
        if counts is None:
            return
        row = self.role_counts[role][index]
        row[SEEN].add_(numel)
        row[NONZERO:].add_(counts)
        if bins is not None and self.role_amax_bins[role].shape[1]:
            self.role_amax_bins[role][index].add_(bins)

    def _record_at(
        self, row: Tensor, role: int, amax: Tensor, scale: Tensor, numel: int, counts: Tensor | None, bins: Tensor | None
    ) -> None:
        """:meth:`record` at a row given as a one-element tensor: read, combine, write back with ``index_put_``."""
        at = (row,)
        self.role_scale[role].index_put_(at, scale.reshape(1).to(torch.float32))
        pending = self.role_amax_pending[role]
        pending.index_put_(at, torch.maximum(pending.index_select(0, row), amax.float().reshape(1)))
        if counts is None:
            return
        counters = self.role_counts[role]
        # [numel, counts...] added in one addition: every graph node a compiled cast adds lengthens the chains that the
        # partitioner refuses to recompute past 100 nodes (tests/test_compiled_saved_casts.py). constant_pad_nd, not
        # F.pad: F.pad's value is a float, which fixes a symbolic numel to its value (a graph per token count)
        added = torch.constant_pad_nd(counts.reshape(1, -1), (NONZERO - SEEN, 0), numel)  # (1, 4)
        counters.index_put_(at, counters.index_select(0, row) + added)
        if bins is not None and self.role_amax_bins[role].shape[1]:
            histogram = self.role_amax_bins[role]
            histogram.index_put_(at, histogram.index_select(0, row) + bins.reshape(1, -1))

    @torch.no_grad()
    def roll(self) -> None:
        """Push every pending amax into its history (where one was recorded) and zero the pending amaxes; for
        ``delayed``, derive every scale from its history. A constant number of operations for all layers.

        A zero pending amax means the tensor was not cast since the last roll (the layer did not run, or a
        second optimizer stepped in the same training step): its history stays as it is. A NaN pending amax
        is recorded, and ignored by the ``delayed`` formula.

        The updates go through ``.data``, which leaves autograd's version counters alone: a standalone
        ``fp8_autocast()`` rolls on exit, between a forward and its backward, and a ``torch.compile``d backward
        keeps the grad_output state it records into as saved tensors. The backward is meant to see the rolled
        state (its gradient scale comes from the updated history); no state tensor ever requires grad.
        """
        self.generation += 1
        pending = self.amax_pending  # (L, 3), stacked
        history = self.amax_history.data
        recorded = (pending != 0).unsqueeze(-1)
        shifted = torch.cat([pending.unsqueeze(-1), history[..., :-1]], dim=-1)
        history.copy_(torch.where(recorded, shifted, history))
        torch._foreach_zero_([t.data for t in self.role_amax_pending])
        if self.recipe.name == "delayed":
            self._derive_delayed_scales()

    def _derive_delayed_scales(self) -> None:
        """``delayed``: every scale from its history (a zero or non-finite reference amax keeps the scale)."""
        history = self.amax_history.data
        usable = torch.where(torch.isfinite(history), history, torch.zeros_like(history))
        amax_ref = usable.amax(dim=-1) if self.recipe.amax_compute_algo == "max" else usable[..., 0]
        new_scale = amax_to_scale(amax_ref, self._role_max(), self.recipe.margin, self.recipe.round_to_power_of_2)
        ok = amax_ref > 0
        scale = torch.where(ok, new_scale, self.scale)
        torch._foreach_copy_([t.data for t in self.role_scale], list(scale.unbind(1)))
        self.history_scale.data.copy_(scale)
        self.initialized.data.logical_or_(ok)
        self.publish_forward_history()

    @torch.no_grad()
    def rescale_grad_output(self, ratio: Tensor) -> None:
        """Multiply the grad_output amaxes (history and pending) by ``ratio`` (a device scalar).

        With dynamic loss scaling the gradients a layer casts are multiplied by the loss scale; when the scale
        changes by ``ratio``, the amaxes recorded under the old scale are brought into the new scale's domain and,
        for ``delayed``, the scales are derived again, so the next grad_output cast fits the gradients it is
        applied to (input and weight scales come out unchanged: their histories did not move).
        """
        ratio = ratio.to(device=self.device, dtype=torch.float32)
        # no new generation: the input and weight scales do not move, so the weights' FP8 casts stay valid
        self.amax_history.data[:, GRAD_OUTPUT].mul_(ratio)  # .data: see roll()
        self.role_amax_pending[GRAD_OUTPUT].data.mul_(ratio)
        if self.recipe.name == "delayed":
            self._derive_delayed_scales()

    @torch.no_grad()
    def reset_counters(self) -> None:
        """Zero the element counters and amax histograms (a new per-rank baseline) and bump ``counts_epoch``."""
        torch._foreach_zero_([t.data for t in (*self.role_counts, *self.role_amax_bins)])  # .data: see roll()
        self.counts_epoch.data.add_(1)

    # ------------------------------------------------------------------ rows
    def copy_rows_from(self, source: FP8StateTable, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy rows ``src`` of ``source`` (same recipe) into rows ``dst`` of this table."""
        if not src:
            return
        src_index = torch.tensor(list(src), device=source.device)
        dst_index = torch.tensor(list(dst), device=self.device)
        for name, tensor in source.tensors().items():
            self.set_rows(name, dst_index, tensor.index_select(0, src_index))


# ---------------------------------------------------------------------- layers <-> tables


class FP8StateRef:
    """What a layer holds: its table and its row. Layers expose the row as views (``fp8_scale``...).

    Compiled code addresses the row through :meth:`row`, a tensor, not the Python ``index``: ``torch.compile``
    makes an integer it reads a constant of the graph, guarded, so identical blocks compiled one by one (the usual
    way to compile a transformer) would each compile a graph of their own, and past torch's recompile limit (8 by
    default) the remaining blocks would run eager with only a warning. With a tensor row they share one graph.
    """

    __slots__ = ("table", "index", "_row")

    def __init__(self, table: FP8StateTable, index: int) -> None:
        self.table = table
        self.index = index
        self._row: Tensor | None = None
        self.follow_table()

    def follow_table(self) -> None:
        """Keep :meth:`row` on the table's device (called at construction and when the layer moves)."""
        if self._row is None or self._row.device != self.table.device:
            self._row = torch.tensor([self.index], dtype=torch.int64, device=self.table.device)

    def row(self) -> Tensor | int:
        """The row for compiled code: ``[index]``, a one-element int64 tensor on the table's device (see the class
        docstring; a 0-d one would be read as an int again), or the int itself if the table moved without the layer
        (correct, one graph per layer)."""
        row = self._row
        if row is None or row.device != self.table.device:
            return self.index
        return row

    def __deepcopy__(self, memo: dict[int, Any]) -> FP8StateRef:
        import copy

        return FP8StateRef(copy.deepcopy(self.table, memo), self.index)

    def __getstate__(self) -> tuple[FP8StateTable, int]:
        return self.table, self.index

    def __setstate__(self, state: tuple[FP8StateTable, int]) -> None:
        self.table, self.index = state
        self._row = None
        self.follow_table()


def fp8_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(qualified name, module)`` for every module of ``model`` that holds FP8 state (each module once).

    The state is read from the module's own attributes: ``torch.compile``'s wrapper of a layer forwards attribute
    reads to the layer, and is not a second layer (the layer comes next, as ``<name>._orig_mod``)."""
    for name, module in model.named_modules():
        if isinstance(module.__dict__.get("fp8_state"), FP8StateRef):
            yield name, module


def without_orig_mod(name: str) -> str:
    """``name`` without the ``_orig_mod`` components that ``torch.compile``'s wrapper adds to module names (a model or
    a block compiled and put back in its model): the name the layer has in the same model uncompiled."""
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


def fp8_modules(model: nn.Module) -> dict[str, nn.Module]:
    """All modules of ``model`` that carry FP8 state, keyed by qualified name."""
    return dict(fp8_layers(model))


def state_tables(model: nn.Module) -> list[FP8StateTable]:
    """The distinct state tables of ``model``'s FP8 layers, in the order of the layers."""
    seen: dict[int, FP8StateTable] = {}
    for _, module in fp8_layers(model):
        table = module.fp8_state.table
        seen.setdefault(id(table), table)
    return list(seen.values())


def bind_state_tables(model: nn.Module) -> list[FP8StateTable]:
    """Gather the FP8 state of all of ``model``'s FP8 layers into one table per recipe, in place.

    Each layer keeps its values (its row is copied into the new table). Returns the tables; a model whose
    layers already share one table per recipe, in layer order, is left as it is. Called by
    :func:`~lightning_fp8.convert_to_fp8` and the precision plugin at setup (never on the step path).
    """
    groups: dict[FP8Recipe, list[nn.Module]] = {}
    for _, module in fp8_layers(model):
        groups.setdefault(module.fp8_state.table.recipe, []).append(module)
    tables = []
    for recipe, modules in groups.items():
        refs = [m.fp8_state for m in modules]
        first = refs[0].table
        if all(r.table is first for r in refs) and [r.index for r in refs] == list(range(first.num_layers)):
            tables.append(first)
            continue
        devices = {r.table.device for r in refs}
        if len(devices) > 1:
            raise ValueError(f"FP8 layers of one model are on several devices ({sorted(map(str, devices))}); move the model first")
        table = FP8StateTable(recipe, len(modules), device=devices.pop())
        by_source: dict[int, tuple[FP8StateTable, list[int], list[int]]] = {}
        for row, ref in enumerate(refs):
            entry = by_source.setdefault(id(ref.table), (ref.table, [], []))
            entry[1].append(ref.index)
            entry[2].append(row)
        for source, src, dst in by_source.values():
            table.copy_rows_from(source, src, dst)
        for row, module in enumerate(modules):
            module.fp8_state = FP8StateRef(table, row)
        tables.append(table)
    return tables


def compiled_forward_marks() -> dict[int, tuple[weakref.ReferenceType[FP8StateTable], int]]:
    """Every live table's :meth:`~FP8StateTable.compiled_forward_count`, by the table's ``id`` (with a weak reference
    to tell a new table that reuses the ``id``): taken when a standalone region is entered, it tells at the exit which
    tables its compiled layers ran with (:func:`tables_marked_since`). Tables made under ``torch.inference_mode()``
    are left out."""
    marks = {}
    for table in _live_tables():
        count = table.compiled_forward_count()
        if count is not None:
            marks[id(table)] = (weakref.ref(table), count)
    return marks


def tables_marked_since(marks: dict[int, tuple[weakref.ReferenceType[FP8StateTable], int]]) -> list[FP8StateTable]:
    """The live tables that compiled layers marked since ``marks`` (:func:`compiled_forward_marks`) were taken, tables
    made since then (a copy made inside the region that then ran compiled) included."""
    marked = []
    for table in _live_tables():
        count = table.compiled_forward_count()
        if count is None:
            continue
        then = marks.get(id(table))
        before = then[1] if then is not None and then[0]() is table else 0  # a table made since: from zero
        if count != before:
            marked.append(table)
    return marked


@torch.no_grad()
def roll_amax_history(model: nn.Module | Iterable[FP8StateTable]) -> None:
    """Push every FP8 layer's pending amax into its history (and, for ``delayed``, update the scale).

    A constant number of tensor operations per state table (one table per recipe once the model is
    bound). The precision plugin calls it once per optimizer step; ``fp8_autocast()`` used on its own calls
    it when the outermost region exits.
    """
    tables = state_tables(model) if isinstance(model, nn.Module) else list(model)
    for table in tables:
        table.roll()


# ---------------------------------------------------------------------- export / import


def fp8_state_dict(model: nn.Module) -> dict[str, Any]:
    """Export the FP8 state of every FP8 layer of ``model``.

    The result holds only tensors (copies, on the layers' device) and plain Python values, so it can be
    saved with ``torch.save`` and loaded with ``torch.load(weights_only=True)``::

        {"version": 2, "roles": ["input", "weight", "grad_output"], "count_fields": [...],
         "tables": [{"recipe": {...}, "layers": [qualified names, one per row],
                     "scale": (L, 3), "amax_history": (L, 3, H), "amax_pending": (L, 3),
                     "counts": (L, 3, 4), "initialized": (L, 3), "counts_epoch": (L,),
                     "amax_bins": (L, 3, B)}, ...]}
                                                                  # one table per recipe

    Use :func:`layer_state` to read one layer's rows. A bound model exports each table with one copy per
    tensor, whatever the number of layers.
    """
    groups: dict[FP8Recipe, list[tuple[str, FP8StateRef]]] = {}
    for name, module in fp8_layers(model):
        groups.setdefault(module.fp8_state.table.recipe, []).append((name, module.fp8_state))
    tables = []
    for recipe, entries in groups.items():
        refs = [ref for _, ref in entries]
        first = refs[0].table
        whole = all(r.table is first for r in refs) and [r.index for r in refs] == list(range(first.num_layers))
        if whole:
            values = {name: tensor.detach().clone() for name, tensor in first.tensors().items()}
        else:
            parts: dict[str, list[Tensor]] = {name: [] for name in STATE_FIELDS}
            for ref in refs:  # a partly bound model: one slice per layer (setup-time sizes)
                for name, tensor in ref.table.tensors().items():
                    parts[name].append(tensor[ref.index : ref.index + 1])
            values = {name: torch.cat(chunks).detach().clone() for name, chunks in parts.items()}
        tables.append({"recipe": recipe.to_dict(), "layers": [name for name, _ in entries], **values})
    return {"version": STATE_FORMAT_VERSION, "roles": list(ROLES), "count_fields": list(COUNT_FIELDS), "tables": tables}


def layer_state(state: dict[str, Any], name: str) -> dict[str, Any]:
    """One layer's entry of an :func:`fp8_state_dict` export: ``{"recipe": {...}, "scale": (3,), ...}`` (views)."""
    for table in _upgrade(state)["tables"]:
        if name in table["layers"]:
            row = table["layers"].index(name)
            return {"recipe": table["recipe"], **{field: table[field][row] for field in STATE_FIELDS}}
    raise KeyError(f"no FP8 layer {name!r} in this state (layers: {fp8_state_layer_names(state)})")


def fp8_state_layer_names(state: dict[str, Any]) -> list[str]:
    """The qualified names of the layers in an :func:`fp8_state_dict` export."""
    return [name for table in _upgrade(state)["tables"] for name in table["layers"]]


_V1_BUFFERS = {
    "fp8_scale": "scale",
    "fp8_amax_history": "amax_history",
    "fp8_amax_pending": "amax_pending",
    "fp8_counts": "counts",
    "fp8_initialized": "initialized",
}


def _upgrade(state: Any) -> dict[str, Any]:
    """Validate an export; convert the per-layer format of lightning-fp8 0.1 (version 1) to version 2."""
    version = state.get("version") if isinstance(state, dict) else type(state).__name__
    if version == STATE_FORMAT_VERSION:
        if all("amax_bins" in table for table in state["tables"]):
            return state
        return {**state, "tables": [_with_amax_bins(table) for table in state["tables"]]}
    if version != 1:
        raise ValueError(f"Unknown FP8 state format (expected version {STATE_FORMAT_VERSION} or 1, got {version})")
    groups: dict[FP8Recipe, list[tuple[str, dict[str, Any]]]] = {}
    for name, entry in state["layers"].items():
        groups.setdefault(FP8Recipe.from_dict(entry["recipe"], legacy=True), []).append((name, entry))
    tables = []
    for recipe, entries in groups.items():
        table: dict[str, Any] = {"recipe": recipe.to_dict(), "layers": [name for name, _ in entries]}
        for old, new in _V1_BUFFERS.items():
            table[new] = torch.stack([entry[old] for _, entry in entries])
        table["counts_epoch"] = torch.zeros(len(entries), dtype=torch.int64, device=table["scale"].device)
        tables.append(_with_amax_bins(table))
    return {"version": STATE_FORMAT_VERSION, "roles": list(ROLES), "count_fields": list(COUNT_FIELDS), "tables": tables}


def _with_amax_bins(table: dict[str, Any]) -> dict[str, Any]:
    """A saved table from before the amax histograms (lightning-fp8 0.2 and older): empty histograms."""
    if "amax_bins" in table:
        return table
    bins = amax_bin_count(FP8Recipe.from_dict(table["recipe"]))
    layers, device = len(table["layers"]), table["scale"].device
    return {**table, "amax_bins": torch.zeros(layers, len(ROLES), bins, dtype=torch.int64, device=device)}


@torch.no_grad()
def load_fp8_state_dict(model: nn.Module, state: dict[str, Any], strict: bool = True, counters: bool = True) -> None:
    """Import a state made by :func:`fp8_state_dict` (or by lightning-fp8 0.1) into ``model``'s FP8 layers.

    Layers are matched by qualified name, without the ``_orig_mod`` components ``torch.compile`` inserts (as torch's
    distributed checkpoint helpers match the weights), so a state saved compiled loads into the model uncompiled and
    back. A constant number of tensor operations per table.

    Args:
        model: the model whose FP8 layers receive the state.
        state: the export.
        strict: require the saved and current sets of FP8 layers to be equal.
        counters: also restore the element counters (and amax histograms); ``False`` zeroes them and bumps their
            ``counts_epoch``
            (a fresh per-rank baseline: the precision plugin does this when resuming with more than one rank,
            since a checkpoint holds the counters of the rank that saved it).

    Raises:
        ValueError: if a layer's saved recipe differs from its current recipe (never a silent mix of
            recipes), if the format version is unknown, or, with ``strict=True``, if the saved and current
            sets of FP8 layers differ. Nothing is changed when it raises.
    """
    state = _upgrade(state)
    current = {without_orig_mod(name): module.fp8_state for name, module in fp8_layers(model)}
    saved_names = [without_orig_mod(name) for table in state["tables"] for name in table["layers"]]
    if strict:
        missing = sorted(set(current) - set(saved_names))
        unexpected = sorted(set(saved_names) - set(current))
        if missing or unexpected:
            raise ValueError(
                f"FP8 state does not match the model's FP8 layers: missing {missing}, unexpected {unexpected}"
                + (
                    ". Layers in FP8 here but not in the checkpoint were kept in high precision when it was saved (an "
                    "`exclude` pattern, or switched by FP8FallbackCallback): resume with the same `exclude`, or with "
                    "FP8FallbackCallback, which switches them again before training"
                    if missing
                    else ""
                )
            )
    plan: list[tuple[dict[str, Any], dict[int, tuple[FP8StateTable, list[int], list[int]]]]] = []
    for saved in state["tables"]:
        recipe = FP8Recipe.from_dict(saved["recipe"])
        targets: dict[int, tuple[FP8StateTable, list[int], list[int]]] = {}
        for row, name in enumerate(saved["layers"]):
            ref = current.get(without_orig_mod(name))
            if ref is None:
                continue
            if ref.table.recipe != recipe:
                raise ValueError(
                    f"FP8 layer {name!r} was saved with recipe {recipe.to_dict()} but is configured with "
                    f"{ref.table.recipe.to_dict()}. Resume with the same FP8Precision settings, or drop the FP8 state "
                    "(the weights are recipe-free) by loading the model state_dict alone."
                )
            entry = targets.setdefault(id(ref.table), (ref.table, [], []))
            entry[1].append(row)
            entry[2].append(ref.index)
        plan.append((saved, targets))
    for saved, targets in plan:
        for table, src, dst in targets.values():
            src_index = torch.tensor(src, device=saved["scale"].device)
            dst_index = torch.tensor(dst, device=table.device)
            for name in STATE_FIELDS:
                values = saved[name].index_select(0, src_index)
                if name in ("counts", "amax_bins") and not counters:
                    values = torch.zeros_like(values)
                elif name == "counts_epoch" and not counters:  # differs from the saved and the current epoch
                    current = table.counts_epoch.index_select(0, dst_index).to(values.device)
                    values = torch.maximum(values, current) + 1
                table.set_rows(name, dst_index, values)
