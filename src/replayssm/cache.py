"""Slot storage common to both layer kinds: anchor, read copy, replay buffer, per-slot cursors.

Layout (``rows = num_slots + 1``: the last row is a scratch slot that pad ids (-1) are routed
to, so that a batch with pads needs no host-side filtering and no branch):

- ``anchor``: dict of physical parts of the anchor format for a logical fp32 tensor
  [rows, nheads, dv / rb, rb, dk] (rb = row_block = gcd(dv, 32); see ``formats``; NVFP4's global
  scale is per (slot, head, row block)); ``read_copy``: the same for the read format, or
  ``None`` when the precision is shared (outputs then read the anchor).
- ``buffer``: dict of per-token replay entries, each [rows, window, ...]; entry ``p`` of a slot
  holds the token at position ``p`` after its checkpoint. Positions ``[0, committed)`` are
  committed, ``[committed, committed + pending)`` are drafts awaiting ``accept``. The fields that
  hold inputs as given (Mamba-2's x and B, GDN's and KDA's v) have ``buffer_dtype``; by default
  (``buffer_dtype=None``) that is the dtype of the first decode or verify call's inputs, so bf16
  activations are buffered as bf16 (exactly, in half the bytes of fp32) and fp32 ones as fp32. Until
  that call the buffer is ``None``: nothing was ever buffered.
- cursors, each [rows]: ``committed`` (int32, h), ``pending`` (int32, T of the pending verify),
  ``refreshes`` (int64), ``tokens`` (int64, committed tokens since ``load_state``; the logical
  time that keys stochastic rounding), ``seeds`` (int64, per-slot rounding seed).
- ``draft_gaps`` int32 [rows, max_draft]: s - 1 - parent of the pending verify's draft s (zero
  for a chain, i.e. always except between a tree verify and its ``accept``), against which
  ``accept`` checks a path (``pending_parents``).

Fresh storage is zero (NaN for float storage of real slots under ``poison_fresh_allocations``);
the scratch row is always zero-initialized, so two caches built alike hold identical bytes. A slot
that was never loaded holds no state of its own: call ``load_state`` or ``reset`` first.

Every public method validates its arguments before writing (``checks``) and runs under
``torch.no_grad()``: decoding is inference, and inputs that require grad must not make the
storage part of an autograd graph that grows with every token.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import threading

import torch

from . import checks
from .backend import pick_backend
from .formats import random_bits
from .precision import Precision, get_precision

_DTYPE_NAMES = {"None": None, **{str(d): d for d in checks.FLOAT_DTYPES}}  # config()'s buffer_dtype
ROW_BLOCK = 32  #: rows of a head's state per storage block (see ``ReplayCache.__init__``)

# Per thread, so that one thread's test switch never changes the caches another thread builds.
_POISON = threading.local()


def _poisoning() -> bool:
    return getattr(_POISON, "on", False)


@contextlib.contextmanager
def poison_fresh_allocations(enabled: bool = True):
    """Within the block (in this thread only), fill the float storage of the real slots of every
    newly built cache with NaN, so that reads of never-written memory show up (tests).
    ``enabled=False`` turns it off inside an enclosing block."""
    old = _poisoning()
    _POISON.on = bool(enabled)
    try:
        yield
    finally:
        _POISON.on = old


def _alloc(shape, dtype, device, poison):
    t = torch.zeros(shape, dtype=dtype, device=device)
    if poison and t.is_floating_point():
        t.fill_(float("nan"))
    return t


def describe_precision(obj) -> str:
    """Every field of a precision, its formats' fields included, as one string: two precisions
    that round differently never describe alike, even under one name."""
    if obj is None or isinstance(obj, (str, int, float, bool, torch.dtype)):
        return repr(obj)
    if dataclasses.is_dataclass(obj):
        items = [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    else:
        items = sorted(vars(obj).items())
    inner = ", ".join(f"{k}={describe_precision(v)}" for k, v in items)
    return f"{type(obj).__module__}.{type(obj).__qualname__}({inner})"


def _inference(method):
    """Run a public cache method under ``torch.no_grad()`` (see the module docstring)."""
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        with torch.no_grad():
            return method(*args, **kwargs)
    return wrapper


def _where_rows(mask, new, old):
    """torch.where with a per-row mask [b] broadcast over the trailing dims."""
    return torch.where(mask.view(-1, *([1] * (new.dim() - 1))), new, old)


class ReplayCache:
    """Base class of ``Mamba2Cache`` and ``GDNCache``.

    Subclasses set ``kind``, the geometry, ``buffer_fields`` (name -> (per-token shape, dtype);
    dtype ``None`` for the fields that hold inputs as given: they take ``buffer_dtype``) and
    implement ``_fold`` (the committed state from a checkpoint and buffered entries).
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
        if buffer_dtype is not None and buffer_dtype not in checks.FLOAT_DTYPES:
            raise ValueError(f"buffer_dtype must be None (the inputs' dtype) or one of {checks.FLOAT_DTYPES}, "
                             f"got {buffer_dtype}")
        self.num_slots, self.nheads, self.dv, self.dk = num_slots, nheads, dv, dk
        self.window, self.max_draft = window, max_draft
        self.precision: Precision = get_precision(precision)
        self.device = torch.empty(0, device=device).device  # 'cuda' -> 'cuda:0', as tensors report it
        self.buffer_dtype = buffer_dtype
        self.follows_inputs = buffer_dtype is None  # the first decode or verify picks buffer_dtype
        self._buffer_fields = buffer_fields
        self.seed = seed
        self.check_values = True
        rows = num_slots + 1
        self.scratch_row = num_slots
        poison = _poisoning()
        # Storage splits each head's rows into blocks of ROW_BLOCK rows, [rows, H, dv/rb, rb, dk]:
        # the same bytes for every format, except that NVFP4's per-matrix global scale becomes one
        # per (slot, head, row block), so a kernel program owning a row block can encode alone.
        self.row_block = rb = math.gcd(dv, ROW_BLOCK)
        shape = (rows, nheads, dv // rb, rb, dk)
        self.anchor = self._alloc_parts(self.precision.anchor, shape, poison)
        self.read_copy = (None if self.precision.shared
                          else self._alloc_parts(self.precision.read, shape, poison))
        self.buffer = None if buffer_dtype is None else self._alloc_buffer(buffer_dtype, poison)
        for t in self._storage():  # pads write and read here: deterministic, even when poisoned
            t[self.scratch_row].zero_()
        self.committed = torch.zeros(rows, dtype=torch.int32, device=self.device)
        self.pending = torch.zeros(rows, dtype=torch.int32, device=self.device)
        self.refreshes = torch.zeros(rows, dtype=torch.int64, device=self.device)
        self.tokens = torch.zeros(rows, dtype=torch.int64, device=self.device)
        self.seeds = torch.full((rows,), seed, dtype=torch.int64, device=self.device)
        self.draft_gaps = torch.zeros(rows, max_draft, dtype=torch.int32, device=self.device)
        # how many of a refreshing slot's step programs have finished the step (``launch.advance_row``):
        # zero between steps, so neither state nor configuration
        self.programs_done = torch.zeros(rows, dtype=torch.int32, device=self.device)
        # logical element index inside one slot's state: keys stochastic rounding
        self._offsets = torch.arange(nheads * dv * dk, device=self.device).view(nheads, dv // rb, rb, dk)

    def _alloc_parts(self, fmt, shape, poison):
        parts = fmt.allocate(shape, self.device, fill=0)
        if poison:
            for t in parts.values():
                if t.is_floating_point() and t.element_size() > 1:
                    t.fill_(float("nan"))
        return parts

    def _alloc_buffer(self, dtype, poison):
        buf = {name: _alloc((self.num_slots + 1, self.window, *tail), dtype if d is None else d, self.device, poison)
               for name, (tail, d) in self._buffer_fields.items()}
        for t in buf.values():
            t[self.scratch_row].zero_()
        return buf

    def follow_inputs(self, dtype) -> None:
        """Give the buffer its dtype from the inputs of the first decode or verify (the calls do
        this; ``dtype`` is x's for Mamba-2, v's for GDN and KDA). A no-op once the buffer exists.
        Allocates: call it before capturing a CUDA graph, or decode once first."""
        if dtype not in checks.FLOAT_DTYPES:
            raise ValueError(f"dtype must be one of {checks.FLOAT_DTYPES}, got {dtype}")
        if self.buffer is None:
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                # a captured allocation would replay its zero fill at every replay, wiping the buffer
                raise ValueError("the replay buffer of a cache with buffer_dtype=None is allocated by its first "
                                 "decode or verify: call cache.follow_inputs(dtype) (or decode once) before "
                                 "capturing a CUDA graph")
            self.buffer = self._alloc_buffer(dtype, _poisoning())
            self.buffer_dtype = dtype

    def _storage(self):
        parts = [*self.anchor.values(), *(self.buffer or {}).values()]
        return parts + ([] if self.read_copy is None else list(self.read_copy.values()))

    # ---- geometry ------------------------------------------------------------------------
    @property
    def state_shape(self) -> tuple:
        """Per-slot state shape (nheads, dv, dk)."""
        return (self.nheads, self.dv, self.dk)

    def bytes_per_slot(self) -> dict:
        """Physical bytes of one slot: anchor, read copy, replay buffer (before the first decode
        or verify of a cache that follows its inputs: the buffer of fp32 inputs, an upper bound)."""
        def nbytes(parts):
            return 0 if parts is None else sum(t[0].numel() * t.element_size() for t in parts.values())
        buffer = nbytes(self.buffer) if self.buffer is not None else sum(
            self.window * math.prod(tail) * (d or torch.float32).itemsize for tail, d in self._buffer_fields.values())
        return {"anchor": nbytes(self.anchor), "read_copy": nbytes(self.read_copy), "buffer": buffer}

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

    @_inference
    def load_state(self, slots, state, seeds=None):
        """Seed checkpoints from full states [b, nheads, dv, dk] (fp32/fp16/bf16); empties the
        buffer. ``slots`` int32/int64 [b] (-1 = pad, skipped).

        ``seeds`` (optional int64 [b]) sets each slot's stochastic-rounding seed; by default the
        cache seed.
        """
        slots = checks.slot_ids(self, slots)
        b = slots.shape[0]
        checks.check_tensor("state", state, (b, *self.state_shape), self.device)
        checks.check_tensor("seeds", seeds, (b,), self.device, (torch.int64,), optional=True)
        rows, valid = self.rows_of(slots)
        self.seeds[rows] = torch.where(valid, self.seed if seeds is None else seeds, self.seeds[rows])
        zero = torch.zeros_like(self.tokens[rows])
        # programs_done is zero between steps; a slot loaded afresh starts there whatever came before
        for cur in (self.committed, self.pending, self.refreshes, self.tokens, self.programs_done):
            cur[rows] = torch.where(valid, zero.to(cur.dtype), cur[rows])
        self.draft_gaps[rows] = torch.where(valid[:, None], 0, self.draft_gaps[rows])
        self.write_checkpoint(rows, state.float(), valid)

    @_inference
    def reset(self, slots):
        """Give ``slots`` (int32/int64 [b]) a zero state and an empty buffer (a recycled slot
        starts clean)."""
        slots = checks.slot_ids(self, slots)
        state = torch.zeros(slots.shape[0], *self.state_shape, device=self.device)
        self.load_state(slots, state)

    @_inference
    def materialize(self, slots):
        """Committed state of each slot, fp32 [b, nheads, dv, dk], from the anchor and the
        committed buffer; the cache is not modified. Pad rows are zero."""
        slots = checks.slot_ids(self, slots)
        rows, valid = self.rows_of(slots)
        if self.buffer is None:  # nothing was ever buffered: the checkpoint is the state
            state = self.decode_anchor(rows)
        else:
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

    @_inference
    def accept(self, slots, num_accepted, path=None, backend=None):
        """Commit ``num_accepted[b]`` drafts of each slot's pending verify.

        ``slots`` int32/int64 [b]; ``num_accepted`` int32/int64 [b], 0 <= n <= pending.
        ``path`` (int32/int64 [b, W], W <= max_draft; None = drafts 0, 1, 2, ...): after a tree
        verify, its first n entries of row i are the accepted drafts in order, path[i, 0] a child
        of the last committed token and each next one a child of the previous. Their buffer
        entries (every field, cached residuals included) are copied into committed order, h ..
        h + n - 1; no state is copied. Rejected drafts stay in the buffer beyond the committed
        pointer and are overwritten later. ``backend`` as in the decode calls: Triton by default
        for CUDA caches (one launch; with a path, one more before it that moves the entries).
        """
        triton = pick_backend(self, backend) == "triton"
        slots = checks.slot_ids(self, slots, keep_int32=triton)
        num_accepted = checks.accepted_counts(self, slots, num_accepted, keep_int32=triton)
        path = checks.accepted_path(self, slots, num_accepted, path, keep_int32=triton)
        if self.buffer is None:  # no verify ever ran: nothing is pending, there is nothing to commit
            return
        if triton:  # the entries moved, then one launch for the cursors (draft
            from ._triton import launch  # gaps included), and no other kernel: at batch 1 each costs a launch
            launch.accept(self, slots, num_accepted, path)
        else:
            rows, valid = self.rows_of(slots)
            if path is not None:
                self._compact(rows, torch.where(valid, num_accepted, 0), path)
            n = torch.minimum(num_accepted.clamp(min=0), self.pending[rows].long()).to(torch.int32)
            n = torch.where(valid, n, 0)
            self.committed[rows] += n
            self.tokens[rows] += n.long()
            self.pending[rows] = torch.where(valid, 0, self.pending[rows])
            # the next verify is a chain unless it says otherwise
            self.draft_gaps[rows] = torch.where(valid[:, None], 0, self.draft_gaps[rows])

    def _compact(self, rows, n, path):
        """Copy the buffer entries of the accepted drafts h + path[:, k] to h + k for k < n
        (gathered first: a source may be another row's destination). Other entries keep their bits."""
        h = self.committed[rows].long()
        cols = torch.arange(path.shape[1], device=self.device)[None, :]
        take = cols < n[:, None]  # [b, W]
        src = (h[:, None] + path.clamp(min=0)).clamp(max=self.window - 1)
        # distinct positions per row (W <= window): untaken columns write their own bits back
        dst = (h[:, None] + cols) % self.window
        for buf in self.buffer.values():
            moved = buf[rows[:, None], src]
            here = buf[rows[:, None], dst]
            mask = take.view(*take.shape, *([1] * (moved.dim() - 2)))
            buf[rows[:, None], dst] = torch.where(mask, moved, here)

    def pending_parents(self, rows):
        """Parents of the pending verify's drafts of storage ``rows``: int64 [b, max_draft]."""
        s = torch.arange(self.max_draft, device=self.device)
        return s - 1 - self.draft_gaps[rows].long()

    # ---- counters and persistence --------------------------------------------------------
    def counters(self, slots) -> dict:
        """Per-slot cursors as int64 tensors [b]: committed, pending, refreshes, tokens."""
        slots = checks.slot_ids(self, slots)
        rows, _ = self.rows_of(slots)
        return {name: getattr(self, name)[rows].long()
                for name in ("committed", "pending", "refreshes", "tokens")}

    def _tensors(self, buffer=...) -> dict:
        out = {f"anchor.{k}": v for k, v in self.anchor.items()}
        if self.read_copy is not None:
            out.update({f"read_copy.{k}": v for k, v in self.read_copy.items()})
        out.update({f"buffer.{k}": v for k, v in ((self.buffer if buffer is ... else buffer) or {}).items()})
        for name in ("committed", "pending", "refreshes", "tokens", "seeds", "draft_gaps"):
            out[name] = getattr(self, name)
        return out

    def config(self) -> dict:
        return {"kind": self.kind, "num_slots": self.num_slots, "nheads": self.nheads, "dv": self.dv,
                "dk": self.dk, "window": self.window, "max_draft": self.max_draft,
                "precision": self.precision.name, "buffer_dtype": str(self.buffer_dtype),
                "precision_spec": describe_precision(self.precision)}

    def state_dict(self) -> dict:
        """Every tensor of the cache (cloned) plus its configuration; round-trips bit-exactly.
        A cache that follows its inputs (``buffer_dtype=None``) loads the dict of any buffer dtype,
        or of none yet, and takes it on."""
        out = {k: v.clone() for k, v in self._tensors().items()}
        out["config"] = self.config()
        return out

    @_inference
    def load_state_dict(self, sd: dict) -> None:
        """Restore a ``state_dict``. Atomic: every entry is checked (configuration, names,
        shapes, dtypes, and that the cursors describe a possible cache) before anything is
        copied, so a refused dict raises ``ValueError`` naming the entry and leaves the cache
        unchanged."""
        if not isinstance(sd, dict):
            raise ValueError(f"state_dict must be a dict from state_dict(), got {type(sd).__name__}")
        config, buffer, dtype = self.config(), self.buffer, self.buffer_dtype
        theirs = sd.get("config")
        if self.follows_inputs and isinstance(theirs, dict) and theirs.get("buffer_dtype") in _DTYPE_NAMES:
            config["buffer_dtype"] = theirs["buffer_dtype"]
            dtype = _DTYPE_NAMES[theirs["buffer_dtype"]]
            if dtype is None:
                buffer = None
            elif dtype != self.buffer_dtype:  # fresh storage; the current one stays until every check passed
                buffer = self._alloc_buffer(dtype, False)
        if theirs != config:
            raise ValueError(f"state_dict config {theirs} does not match this cache {self.config()}")
        mine = self._tensors(buffer)
        extra = sorted(set(sd) - set(mine) - {"config"})
        if extra:
            raise ValueError(f"state_dict entries {extra} are not entries of this cache")
        for k, t in mine.items():
            v = sd.get(k)
            if not isinstance(v, torch.Tensor) or v.shape != t.shape or v.dtype != t.dtype:
                raise ValueError(f"state_dict entry {k!r} is missing or has the wrong shape/dtype")
            if v.is_meta:  # holds no data: its copy would fail after earlier entries were copied
                raise ValueError(f"state_dict entry {k!r} is on the meta device (no data)")
        self._check_cursors({k: sd[k] for k in ("committed", "pending", "refreshes", "tokens")}, buffer is None)
        gaps = sd["draft_gaps"].long()
        if bool(((gaps < 0) | (gaps > torch.arange(self.max_draft, device=gaps.device))).any()):
            raise ValueError("state_dict entry 'draft_gaps' must lie in [0, s] for draft s "
                             "(a parent in [-1, s))")
        self.buffer, self.buffer_dtype = buffer, dtype
        for k, t in mine.items():
            t.copy_(sd[k])

    def _check_cursors(self, cur, unbuffered=False) -> None:
        """Cursor values that no sequence of calls produces would make a later step read or
        write past a slot's window: refuse them (names the entry and the first bad row).
        ``unbuffered``: the dict has no buffer (no decode or verify ran), so nothing is buffered."""
        c, p = cur["committed"].long(), cur["pending"].long()
        rules = [("committed", (c != 0) & unbuffered, "0 without a buffer"),
                 ("pending", (p != 0) & unbuffered, "0 without a buffer"),
                 ("committed", (c < 0) | (c > self.window), f"in [0, window={self.window}]"),
                 ("pending", (p < 0) | (p > self.max_draft), f"in [0, max_draft={self.max_draft}]"),
                 ("pending", c + p > self.window, f"at most window - committed (window={self.window})"),
                 ("refreshes", cur["refreshes"] < 0, ">= 0"),
                 ("tokens", cur["tokens"] < c, ">= committed")]
        for name, bad, rule in rules:
            if bool(bad.any()):
                row = int(bad.nonzero()[0])
                raise ValueError(f"state_dict entry {name!r} holds {int(cur[name][row])} at row {row}, "
                                 f"which must be {rule}")
