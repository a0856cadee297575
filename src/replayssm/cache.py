"""Slot storage common to both layer kinds: anchor, read copy, replay buffer, per-slot cursors.

Layout (``rows = num_slots + 1``: the last row is a scratch slot that pad ids (-1) are routed
to, so that a batch with pads needs no host-side filtering and no branch):

- ``anchor``: dict of physical parts of the anchor format for a logical fp32 tensor
  [rows, nheads, dv / rb, rb, dk] (rb = row_block = gcd(dv, 32); see ``formats``; NVFP4's global
  scale is per (slot, head, row block)); ``read_copy``: the same for the read format, or
  ``None`` when the precision is shared (outputs then read the anchor).
- ``buffer``: dict of per-token replay entries, each [rows, window, ...]; entry ``p`` of a slot
  holds the token at position ``p`` after its checkpoint. Positions ``[0, committed)`` are
  committed, ``[committed, committed + pending)`` are drafts awaiting ``accept``.
- cursors, each [rows]: ``committed`` (int32, h), ``pending`` (int32, T of the pending verify),
  ``refreshes`` (int64), ``tokens`` (int64, committed tokens since ``load_state``; the logical
  time that keys stochastic rounding), ``seeds`` (int64, per-slot rounding seed).

A slot that was never loaded holds uninitialized memory: call ``load_state`` or ``reset`` first.
"""
from __future__ import annotations

import contextlib
import math

import torch

from . import checks
from .backend import pick_backend
from .formats import random_bits
from .precision import Precision, get_precision

_POISON = False
ROW_BLOCK = 32  #: rows of a head's state per storage block (see ``ReplayCache.__init__``)


@contextlib.contextmanager
def poison_fresh_allocations():
    """Fill every newly allocated float state/buffer with NaN (tests: reads of unwritten memory fail)."""
    global _POISON
    old, _POISON = _POISON, True
    try:
        yield
    finally:
        _POISON = old


def _alloc(shape, dtype, device):
    t = torch.empty(shape, dtype=dtype, device=device)
    if t.is_floating_point():
        t.fill_(float("nan") if _POISON else 0.0)
    else:
        t.zero_()
    return t


def _where_rows(mask, new, old):
    """torch.where with a per-row mask [b] broadcast over the trailing dims."""
    return torch.where(mask.view(-1, *([1] * (new.dim() - 1))), new, old)


class ReplayCache:
    """Base class of ``Mamba2Cache`` and ``GDNCache``.

    Subclasses set ``kind``, the geometry, ``buffer_fields`` (name -> (per-token shape, dtype))
    and implement ``_fold`` (the committed state from a checkpoint and buffered entries).
    """

    kind = "base"

    def __init__(self, num_slots, nheads, dv, dk, *, window, max_draft, precision, device,
                 buffer_dtype, seed, buffer_fields):
        checks.check_int("num_slots", num_slots, 1)
        checks.check_int("window", window, 1)
        checks.check_int("max_draft", max_draft, 1)
        checks.check_int("seed", seed, 0)
        if max_draft > window:
            raise ValueError(f"max_draft ({max_draft}) must be <= window ({window})")
        if buffer_dtype not in checks.FLOAT_DTYPES:
            raise ValueError(f"buffer_dtype must be one of {checks.FLOAT_DTYPES}, got {buffer_dtype}")
        self.num_slots, self.nheads, self.dv, self.dk = num_slots, nheads, dv, dk
        self.window, self.max_draft = window, max_draft
        self.precision: Precision = get_precision(precision)
        self.device = torch.empty(0, device=device).device  # 'cuda' -> 'cuda:0', as tensors report it
        self.buffer_dtype = buffer_dtype
        self.seed = seed
        self.check_values = True
        rows = num_slots + 1
        self.scratch_row = num_slots
        # Storage splits each head's rows into blocks of ROW_BLOCK rows, [rows, H, dv/rb, rb, dk]:
        # the same bytes for every format, except that NVFP4's per-matrix global scale becomes one
        # per (slot, head, row block), so a kernel program owning a row block can encode alone.
        self.row_block = rb = math.gcd(dv, ROW_BLOCK)
        shape = (rows, nheads, dv // rb, rb, dk)
        self.anchor = self._alloc_parts(self.precision.anchor, shape)
        self.read_copy = None if self.precision.shared else self._alloc_parts(self.precision.read, shape)
        self.buffer = {name: _alloc((rows, window, *tail), dtype, self.device)
                       for name, (tail, dtype) in buffer_fields.items()}
        self.committed = torch.zeros(rows, dtype=torch.int32, device=self.device)
        self.pending = torch.zeros(rows, dtype=torch.int32, device=self.device)
        self.refreshes = torch.zeros(rows, dtype=torch.int64, device=self.device)
        self.tokens = torch.zeros(rows, dtype=torch.int64, device=self.device)
        self.seeds = torch.full((rows,), seed, dtype=torch.int64, device=self.device)
        # logical element index inside one slot's state: keys stochastic rounding
        self._offsets = torch.arange(nheads * dv * dk, device=self.device).view(nheads, dv // rb, rb, dk)

    def _alloc_parts(self, fmt, shape):
        parts = fmt.allocate(shape, self.device)
        if _POISON:
            for t in parts.values():
                if t.is_floating_point() and t.element_size() > 1:
                    t.fill_(float("nan"))
        return parts

    # ---- geometry ------------------------------------------------------------------------
    @property
    def state_shape(self) -> tuple:
        """Per-slot state shape (nheads, dv, dk)."""
        return (self.nheads, self.dv, self.dk)

    def bytes_per_slot(self) -> dict:
        """Physical bytes of one slot: anchor, read copy, replay buffer."""
        def nbytes(parts):
            return 0 if parts is None else sum(t[0].numel() * t.element_size() for t in parts.values())
        return {"anchor": nbytes(self.anchor), "read_copy": nbytes(self.read_copy),
                "buffer": nbytes(self.buffer)}

    # ---- slot plumbing -------------------------------------------------------------------
    def rows_of(self, slots):
        """Map slot ids to storage rows (pads -> the scratch row). Returns (rows, valid)."""
        valid = slots >= 0
        return torch.where(valid, slots, self.scratch_row), valid

    def read_parts(self):
        return self.anchor if self.read_copy is None else self.read_copy

    def decode_anchor(self, rows):
        """Anchor of ``rows`` decoded to fp32 [b, nheads, dv, dk]."""
        dec = self.precision.anchor.decode({k: v[rows] for k, v in self.anchor.items()}, self.dk)
        return dec.reshape(-1, *self.state_shape)

    def decode_read(self, rows):
        """Read copy of ``rows`` decoded to fp32 [b, nheads, dv, dk] (the anchor when shared)."""
        dec = self.precision.read_format.decode({k: v[rows] for k, v in self.read_parts().items()},
                                                self.dk)
        return dec.reshape(-1, *self.state_shape)

    def gather(self, rows, count):
        """Buffer entries of ``rows`` as dict of [b, window, ...]; positions >= count[b] are zero.

        Zeroing with ``where`` (not a multiply) keeps stale or uninitialized entries (even NaN)
        out of every later sum.
        """
        keep = torch.arange(self.window, device=self.device)[None, :] < count[:, None]
        out = {}
        for name, buf in self.buffer.items():
            t = buf[rows]
            out[name] = torch.where(keep.view(*keep.shape, *([1] * (t.dim() - 2))), t, 0)
        return out

    def append(self, rows, start, entries):
        """Write entries (dict of [b, T, ...]) at positions start[b] .. start[b] + T - 1."""
        for name, t in entries.items():
            T = t.shape[1]
            pos = start[:, None] + torch.arange(T, device=self.device)[None, :]
            self.buffer[name][rows[:, None], pos] = t.to(self.buffer[name].dtype)

    def write_checkpoint(self, rows, state, mask):
        """Cast the unrounded fp32 ``state`` [b, ...] independently into anchor and read copy.

        Rows where ``mask`` is false keep their bits. Stochastic rounding is keyed by
        (slot seed, logical time = committed tokens, element index), never by the storage row;
        anchor and read copy use separate streams.
        """
        p = self.precision
        stream = self.tokens[rows] * 2

        def bits(s):
            return random_bits(self.seeds[rows].view(-1, 1, 1, 1, 1), s.view(-1, 1, 1, 1, 1), self._offsets)

        targets = [(self.anchor, p.anchor, p.anchor_rounding, stream)]
        if self.read_copy is not None:
            targets.append((self.read_copy, p.read, p.read_rounding, stream + 1))
        for parts, fmt, rounding, s in targets:
            blocked = state.reshape(-1, self.nheads, self.dv // self.row_block, self.row_block, self.dk)
            enc = fmt.encode(blocked, rounding, bits(s) if rounding == "stochastic" else None)
            for name, t in enc.items():
                parts[name][rows] = _where_rows(mask, t, parts[name][rows])

    # ---- the committed state -------------------------------------------------------------
    def _fold(self, state, entries, count):  # pragma: no cover - abstract
        raise NotImplementedError

    def load_state(self, slots, state, seeds=None):
        """Seed checkpoints from full fp32 states [b, nheads, dv, dk]; empties the buffer.

        ``seeds`` (optional int64 [b]) sets each slot's stochastic-rounding seed; by default the
        cache seed. Pad ids are skipped.
        """
        b = checks.check_slots(self, slots)
        checks.check_tensor("state", state, (b, *self.state_shape), self.device)
        checks.check_tensor("seeds", seeds, (b,), self.device, (torch.int64,), optional=True)
        rows, valid = self.rows_of(slots)
        self.seeds[rows] = torch.where(valid, self.seed if seeds is None else seeds, self.seeds[rows])
        zero = torch.zeros_like(self.tokens[rows])
        for cur in (self.committed, self.pending, self.refreshes, self.tokens):
            cur[rows] = torch.where(valid, zero.to(cur.dtype), cur[rows])
        self.write_checkpoint(rows, state.float(), valid)

    def reset(self, slots):
        """Give ``slots`` a zero state and an empty buffer (a recycled slot starts clean)."""
        state = torch.zeros(slots.shape[0], *self.state_shape, device=self.device)
        self.load_state(slots, state)

    def materialize(self, slots):
        """Committed state of each slot, fp32 [b, nheads, dv, dk], from the anchor and the
        committed buffer; the cache is not modified. Pad rows are zero."""
        checks.check_slots(self, slots)
        rows, valid = self.rows_of(slots)
        h = torch.where(valid, self.committed[rows].long(), 0)
        state = self._fold(self.decode_anchor(rows), self.gather(rows, h), h)
        return _where_rows(valid, state, torch.zeros_like(state))

    def refresh(self, rows, need):
        """Fold the committed entries of rows where ``need`` into a new checkpoint (device-side)."""
        h = torch.where(need, self.committed[rows].long(), 0)
        state = self._fold(self.decode_anchor(rows), self.gather(rows, h), h)
        self.write_checkpoint(rows, state, need)
        self.committed[rows] = torch.where(need, 0, self.committed[rows])
        self.refreshes[rows] += need.long()

    def accept(self, slots, num_accepted, backend=None):
        """Commit the first ``num_accepted[b]`` drafts of each slot's pending verify.

        Only the committed pointer moves; rejected drafts stay in the buffer beyond the pointer
        and are overwritten later. ``num_accepted`` int [b], 0 <= n <= pending. ``backend`` as
        in the decode calls: Triton (one launch) by default for CUDA caches.
        """
        checks.check_slots(self, slots)
        checks.check_accepted(self, slots, num_accepted)
        if pick_backend(self, backend) == "triton":
            from ._triton import launch
            return launch.accept(self, slots, num_accepted)
        rows, valid = self.rows_of(slots)
        n = torch.minimum(num_accepted.to(torch.int32).clamp(min=0), self.pending[rows])
        n = torch.where(valid, n, 0)
        self.committed[rows] += n
        self.tokens[rows] += n.long()
        self.pending[rows] = torch.where(valid, 0, self.pending[rows])

    # ---- counters and persistence --------------------------------------------------------
    def counters(self, slots) -> dict:
        """Per-slot cursors as int64 tensors [b]: committed, pending, refreshes, tokens."""
        checks.check_slots(self, slots)
        rows, _ = self.rows_of(slots)
        return {name: getattr(self, name)[rows].long()
                for name in ("committed", "pending", "refreshes", "tokens")}

    def _tensors(self) -> dict:
        out = {f"anchor.{k}": v for k, v in self.anchor.items()}
        if self.read_copy is not None:
            out.update({f"read_copy.{k}": v for k, v in self.read_copy.items()})
        out.update({f"buffer.{k}": v for k, v in self.buffer.items()})
        for name in ("committed", "pending", "refreshes", "tokens", "seeds"):
            out[name] = getattr(self, name)
        return out

    def config(self) -> dict:
        return {"kind": self.kind, "num_slots": self.num_slots, "nheads": self.nheads, "dv": self.dv,
                "dk": self.dk, "window": self.window, "max_draft": self.max_draft,
                "precision": self.precision.name, "buffer_dtype": str(self.buffer_dtype)}

    def state_dict(self) -> dict:
        """Every tensor of the cache (cloned) plus its configuration; round-trips bit-exactly."""
        out = {k: v.clone() for k, v in self._tensors().items()}
        out["config"] = self.config()
        return out

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("config") != self.config():
            raise ValueError(f"state_dict config {sd.get('config')} does not match this cache {self.config()}")
        mine = self._tensors()
        for k, t in mine.items():
            if k not in sd or sd[k].shape != t.shape or sd[k].dtype != t.dtype:
                raise ValueError(f"state_dict entry {k!r} is missing or has the wrong shape/dtype")
        for k, t in mine.items():
            t.copy_(sd[k])
