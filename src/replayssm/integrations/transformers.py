"""Hugging Face transformers integration: run the decode steps of a loaded model through ReplaySSM.

    import replayssm.integrations.transformers as rst
    with rst.patch(model, precision="s32_rs", window=16):
        out = model.generate(input_ids, max_new_tokens=64)

Supported models (transformers ``>=5.24,<5.25``, the range that is tested):

- Mamba-2 and the Mamba-2 hybrids: ``Mamba2ForCausalLM`` (``Mamba2Mixer``), ``NemotronHForCausalLM``
  (``NemotronHMamba2Mixer``), ``FalconH1ForCausalLM`` (``FalconH1Mixer``, beside attention in every
  layer), ``BambaForCausalLM`` (``BambaMixer``), ``GraniteMoeHybridForCausalLM``
  (``GraniteMoeHybridMambaLayer``) and ``Zamba2ForCausalLM`` (``Zamba2MambaMixer``, with its shared
  attention blocks). One adapter serves every Mamba-2 mixer; what the classes do differently
  (FalconH1's muP multipliers and optional gated RMSNorm) is stated once, in ``MAMBA2_MIXERS``.
- Qwen3.5 (``Qwen3_5ForCausalLM``, model_type ``qwen3_5_text``), Qwen3.5-MoE
  (``Qwen3_5MoeForCausalLM``) and Qwen3-Next (``Qwen3NextForCausalLM``): Gated DeltaNet layers
  (``Qwen3_5GatedDeltaNet`` / ``Qwen3_5MoeGatedDeltaNet`` / ``Qwen3NextGatedDeltaNet``)
  interleaved with full-attention layers.
- Kimi-Linear (``KimiLinearForCausalLM``): Kimi Delta Attention layers (``KimiLinearDeltaAttention``)
  interleaved with MLA attention layers.

Attention, MLP and MoE layers always stay with transformers.

What the patch does, per state-space layer (one ReplaySSM cache per layer, one slot per batch row):

- **Prefill** (a forward of more than one token on a cache, or the first forward on it) runs exactly
  as transformers runs it. Its final recurrent state (taken from the transformers cache) seeds the
  ReplaySSM checkpoint with ``load_state``. (GDN: transformers keeps the state as [.., K, V],
  ReplaySSM as [HV, V, K]: it is transposed.)
- **Decode** (one token on a cache that this patch seeded): the layer's own projections and causal
  convolution (the convolution state stays in the transformers cache, updated in place), then
  ``rs.mamba2_decode`` / ``rs.gdn_decode`` / ``rs.kda_decode`` instead of the conventional state update, then the
  layer's own gated RMSNorm and output projection. The recurrent state in the transformers cache is
  *not* written during decode (that is the point); it is written back (``materialize``) whenever
  the stock path needs it again: before a multi-token forward continues that cache, when another
  cache starts being decoded, and at ``unpatch``.
- **Verify** (inside ``ReplayPatch.verifying()``; used by ``speculative_generate``): T tokens go
  through ``rs.mamba2_verify`` / ``rs.gdn_verify`` / ``rs.kda_verify``; the convolution is computed without touching
  its state, and ``ReplayPatch.accept(n)`` commits the first n tokens to both the ReplaySSM caches
  and the convolution states (the last d_conv inputs of the committed position). With
  ``verifying(parents=...)`` the T tokens are a draft tree: the state-space layers get
  ``parents=``, each convolution reads along the token's ancestors, and ``accept(n, path=...)``
  commits the root path ``path[:, :n]`` (PyTorch backend).

Unsupported things raise ``ReplaySSMUnsupported`` (never a silent fall back to the stock path):
a model with no supported layer, a recurrent-mixer class that this module does not know, a
Mamba-2 mixer variant the adapter would not reproduce (the message names the attribute: a
per-channel ``D``, ``n_groups`` not dividing the heads, a KDA layer whose gate or convolution
differs from ``KimiLinearDeltaAttention``'s, ...), beam
search / HF assisted generation / prompt lookup inside ``generate`` (use
``speculative_generate``), a transformers cache that records its past (``activate_past_recording``).
"""
from __future__ import annotations

import contextlib
import types
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:
    import transformers  # noqa: F401
    from transformers.activations import ACT2FN
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("replayssm.integrations.transformers needs the 'hf' extra: "
                      "pip install 'replayssm[hf]' (transformers>=5.24,<5.25)") from e

from ..gdn.cache import GDNCache
from ..gdn.ops import gdn_decode, gdn_verify
from ..kda.cache import KDACache
from ..kda.ops import kda_decode, kda_verify
from ..mamba2.cache import Mamba2Cache
from ..mamba2.ops import mamba2_decode, mamba2_verify

TESTED_TRANSFORMERS = ">=5.24,<5.25"

#: The causal LMs whose state-space layers this integration decodes (every one is tested).
SUPPORTED_MODELS = ("Mamba2ForCausalLM", "NemotronHForCausalLM", "FalconH1ForCausalLM", "BambaForCausalLM",
                    "GraniteMoeHybridForCausalLM", "Zamba2ForCausalLM", "Qwen3_5ForCausalLM",
                    "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM", "KimiLinearForCausalLM")

__all__ = ["ReplaySSMUnsupported", "ReplayPatch", "patch", "unpatch", "get_patch", "Mamba2Family",
           "MAMBA2_MIXERS", "GDN_LAYERS", "KDA_LAYERS", "SUPPORTED_MODELS", "TESTED_TRANSFORMERS"]


class ReplaySSMUnsupported(NotImplementedError):
    """A model, layer type or generation option that the ReplaySSM integration does not support."""


# ---------------------------------------------------------------------------------------------
# the Mamba-2 mixers of transformers, and what each does differently in its decode step
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Mamba2Family:
    """How one transformers Mamba-2 mixer class differs from ``Mamba2Mixer`` in its decode step.

    Every class listed in ``MAMBA2_MIXERS`` has the attributes ``num_heads``, ``head_dim``,
    ``ssm_state_size``, ``n_groups``, ``intermediate_size``, ``conv_dim``, ``in_proj``, ``conv1d``,
    ``activation``, ``dt_bias`` [H], ``A_log`` [H], ``D`` [H], ``norm`` and ``out_proj``, and computes
    one decode token as

        proj = in_proj(h * in_multiplier) * proj_multiplier;  gate, xBC, dt = split(proj)
        x, B, C = split(act(causal_conv(xBC)));  dt = softplus(dt + dt_bias)  (never clamped)
        y = S q + D x  (the recurrence);  y = norm(y, gate)  or, without a norm, y * silu(gate)
        out = out_proj(y)

    What differs between the classes is named here and nowhere else:

    in_multiplier: attribute, a scalar applied to the hidden states before ``in_proj``.
    proj_multiplier: attribute, a [proj] vector applied to ``in_proj``'s output (muP).
    norm_flag: attribute; when false the layer has no gated RMSNorm (``norm`` is the identity)
        and the gate multiplies the recurrence's output as ``silu(gate)`` (the scan's ``z``).

    Common to all, so not listed: ``n_groups`` (B, C shared by num_heads / n_groups heads each),
    a conv bias or none (``use_conv_bias``; Zamba2 always has one), the gated RMSNorm's own
    variant (group size intermediate / n_groups; FalconH1's ``norm_before_gate``), which this
    integration calls as the layer's own module, and ``time_step_limit``: transformers clamps dt
    to it only in the chunked prefill scan, never in the decode step (nor does mamba_ssm's
    ``selective_state_update``), so ReplaySSM decode and verify do not clamp either. Prefill,
    chunked or not, runs the stock path.
    """

    in_multiplier: str | None = None
    proj_multiplier: str | None = None
    norm_flag: str | None = None


#: transformers module -> (mixer class name, its differences). Checked against transformers 5.24.
MAMBA2_MIXERS = {
    "mamba2": ("Mamba2Mixer", Mamba2Family()),
    "nemotron_h": ("NemotronHMamba2Mixer", Mamba2Family()),
    "bamba": ("BambaMixer", Mamba2Family()),
    "granitemoehybrid": ("GraniteMoeHybridMambaLayer", Mamba2Family()),
    "zamba2": ("Zamba2MambaMixer", Mamba2Family()),
    "falcon_h1": ("FalconH1Mixer", Mamba2Family(in_multiplier="ssm_in_multiplier",
                                                 proj_multiplier="mup_vector", norm_flag="mamba_rms_norm")),
}

#: transformers module -> Gated DeltaNet layer class name.
GDN_LAYERS = {"qwen3_5": "Qwen3_5GatedDeltaNet", "qwen3_next": "Qwen3NextGatedDeltaNet",
              "qwen3_5_moe": "Qwen3_5MoeGatedDeltaNet"}

#: transformers module -> Kimi Delta Attention layer class name.
KDA_LAYERS = {"kimi_linear": "KimiLinearDeltaAttention"}


def _import_class(mod: str, name: str):
    try:
        m = __import__(f"transformers.models.{mod}.modeling_{mod}", fromlist=[name])
    except ImportError:  # pragma: no cover - a transformers build without that model
        return None
    return getattr(m, name, None)


def _supported_classes():
    """({Mamba-2 mixer class: Mamba2Family}, (GDN layer classes), (KDA layer classes)) available in
    this transformers."""
    mamba = {}
    for mod, (name, fam) in MAMBA2_MIXERS.items():
        cls = _import_class(mod, name)
        if cls is not None:
            mamba[cls] = fam
    gdn = tuple(c for c in (_import_class(mod, name) for mod, name in GDN_LAYERS.items()) if c is not None)
    kda = tuple(c for c in (_import_class(mod, name) for mod, name in KDA_LAYERS.items()) if c is not None)
    return mamba, gdn, kda


#: softmax-attention classes whose names look recurrent (Kimi-Linear's MLA layers)
_NOT_RECURRENT = frozenset({"KimiLinearAttention"})


def _looks_recurrent(module) -> bool:
    """Class names of recurrent token mixers that this integration does not handle."""
    n = type(module).__name__
    if n in _NOT_RECURRENT:
        return False
    return (("Mamba" in n and (n.endswith("Mixer") or n.endswith("MambaLayer"))) or "GatedDeltaNet" in n
            or n.endswith("LinearAttention")
            or "DeltaNet" in n or "DeltaAttention" in n or n.endswith("ShortConv"))


# ---------------------------------------------------------------------------------------------
# causal convolution (the same arithmetic as transformers' torch ``causal_conv1d_update``)
# ---------------------------------------------------------------------------------------------
def _tree_windows(parents, S: int, W: int):
    """Columns of ``full`` = [conv state (S columns), T fed tokens] that each fed token's
    convolution reads in a draft tree: its W - 1 nearest ancestors (continuing into the conv state
    past the root) and itself, oldest first. parents int64 [b, T] (-1: the last committed token,
    the state's last column), S >= W - 1. Returns int64 [b, T * W]."""
    b, T = parents.shape
    pos = S + torch.arange(T, device=parents.device).expand(b, T)
    cols = [pos]
    for _ in range(W - 1):
        up = S + torch.gather(parents, 1, (pos - S).clamp(min=0))
        pos = torch.where(pos >= S, up, pos - 1)
        cols.append(pos)
    return torch.stack(cols[::-1], -1).reshape(b, T * W)


def _conv_step(x, conv_state, weight, bias, activation, commit: bool, parents=None):
    """x [b, C, T]; conv_state [b, C, S] (S = d_conv). Returns (out [b, C, T], full [b, C, S + T]).

    With ``commit`` the state becomes the last S columns (as ``causal_conv1d_update``); without,
    it is untouched and ``full`` lets the caller commit any prefix later (speculative verify).
    ``parents`` (int64 [b, T], a draft tree of the fed tokens, -1 = the last committed token):
    each token's window runs along its ancestors instead of the previous columns.
    """
    T = x.shape[-1]
    full = torch.cat([conv_state, x], dim=-1).to(weight.dtype)
    if commit:
        conv_state.copy_(full[..., -conv_state.shape[-1]:])
    if parents is None:
        out = F.conv1d(full, weight.unsqueeze(1), bias, padding=0, groups=x.shape[1])[..., -T:]
    else:  # each window gathered side by side, then one strided convolution over them
        W = weight.shape[-1]
        idx = _tree_windows(parents.to(full.device), conv_state.shape[-1], W)
        win = torch.gather(full, 2, idx[:, None, :].expand(full.shape[0], full.shape[1], idx.shape[1]))
        out = F.conv1d(win, weight.unsqueeze(1), bias, stride=W, groups=x.shape[1])
    if activation is not None:
        out = ACT2FN[activation](out) if isinstance(activation, str) else activation(out)
    return out.to(x.dtype), full


def _count_tokens(hf_cache, layer_idx: int, n):
    """Add n (int or 0-d int64 tensor) committed tokens to the layer's token count. transformers >= 5.25
    counts the tokens of a linear-attention layer (``get_seq_length`` reads it when layer 0 is linear, and
    the positions follow); its own decode step adds one in place. A tensor add: no host sync."""
    count = getattr(hf_cache.layers[layer_idx], "cumulative_length_linear", None)
    if count is not None:
        count.add_(n.to(count.device) if torch.is_tensor(n) else n)


# ---------------------------------------------------------------------------------------------
# per-layer adapters
# ---------------------------------------------------------------------------------------------
class _LayerAdapter:
    """State of one patched layer: its ReplaySSM cache, the transformers cache it mirrors, the
    pending convolution inputs of a verify."""

    kind = "base"

    def __init__(self, owner: "ReplayPatch", module):
        self.owner = owner
        self.module = module
        self.layer_idx = module.layer_idx
        self.cache = None          # ReplaySSM cache, allocated on the first prefill
        self.hf_ref = None         # weakref to the transformers cache whose state the slots hold
        self.dirty = False         # decoded since the last load (transformers' state is stale)
        self.batch = 0
        self.pending_full = None   # [b, C, S + T] convolution inputs of the pending verify

    # -- geometry / conversions (per kind) --
    def _new_cache(self, num_slots, device):  # pragma: no cover - abstract
        raise NotImplementedError

    def _to_replay(self, hf_state):
        return hf_state.float()

    def _to_hf(self, state):
        return state

    # -- bookkeeping --
    def slots(self, b, device):
        return torch.arange(b, dtype=torch.int64, device=device)

    def _owned(self, hf_cache) -> bool:
        return self.hf_ref is not None and self.hf_ref() is hf_cache

    def sync_back(self):
        """Write the committed ReplaySSM state into the transformers cache it mirrors."""
        if not self.dirty or self.hf_ref is None:
            self.dirty = False
            return
        hf = self.hf_ref()
        self.dirty = False
        if hf is None:
            return
        rec = hf.get_recurrent_state(self.layer_idx)
        if rec is None:
            return
        state = self.cache.materialize(self.slots(self.batch, self.cache.device))
        rec.copy_(self._to_hf(state).to(rec.dtype))

    def load_from(self, hf_cache):
        """Seed the slots from the transformers cache's recurrent state (after a stock forward)."""
        rec = hf_cache.get_recurrent_state(self.layer_idx)
        if rec is None:
            raise RuntimeError(f"layer {self.layer_idx}: the transformers cache holds no recurrent state")
        b = rec.shape[0]
        if self.cache is None or self.cache.num_slots < b or self.cache.device != rec.device:
            self.cache = self._new_cache(max(b, 1), rec.device)
            self.cache.check_values = self.owner.check_values
        self.batch = b
        self.cache.load_state(self.slots(b, rec.device), self._to_replay(rec).contiguous())
        self.hf_ref = weakref.ref(hf_cache)
        self.dirty = False
        self.pending_full = None

    # -- the patched forward --
    def forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
        if cache is None and "cache_params" in kwargs:
            cache = kwargs.pop("cache_params")
        p = self.owner
        if cache is None:
            if p.mode == "verify":
                raise ReplaySSMUnsupported("verify needs a transformers cache")
            # a cache-less forward (training, scoring): nothing is decoded, the stock path is exact
            return self.stock(hidden_states, cache=None, attention_mask=attention_mask, **kwargs)
        if cache.is_recording_past(self.layer_idx):
            raise ReplaySSMUnsupported(
                "the transformers cache records its past (HF assisted decoding / prompt lookup); "
                "ReplaySSM rolls back with accept(): use replayssm.integrations.speculative")
        seq_len = hidden_states.shape[1]
        has_prev = cache.get_recurrent_state(self.layer_idx) is not None
        if p.mode == "verify" or (seq_len == 1 and has_prev):
            if not has_prev:
                raise RuntimeError("verify needs a prefilled transformers cache")
            if not self._owned(cache):
                # adopt a cache last written by the stock path or synced back when this patch left
                # it (its recurrent state is current either way)
                self._release()
                self.load_from(cache)
            return self.run(hidden_states, cache, verify=p.mode == "verify")
        # prefill or multi-token continuation: the stock path, then seed the checkpoint
        if self._owned(cache):
            self.sync_back()
        else:
            self._release()
        out = self.stock(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
        self.load_from(cache)
        return out

    def _release(self):
        self.sync_back()
        self.hf_ref = None

    def stock(self, *args, **kwargs):
        return type(self.module).forward(self.module, *args, **kwargs)

    def run(self, hidden_states, hf_cache, verify: bool):  # pragma: no cover - abstract
        raise NotImplementedError

    def conv(self, x, hf_cache, verify):
        """Causal convolution of x [b, C, T] against the transformers cache's conv state."""
        conv_state = hf_cache.get_conv_state(self.layer_idx)
        m = self.module
        act = getattr(m, "activation", None)
        out, full = _conv_step(x, conv_state, m.conv1d.weight.squeeze(1), m.conv1d.bias, act,
                               commit=not verify, parents=self.owner.parents if verify else None)
        if verify:
            self.pending_full = full
        else:
            _count_tokens(hf_cache, self.layer_idx, 1)
        return out

    def tree_parents(self):
        """The pending verify's draft tree on the cache's device (int64 [b, T]), or None (a chain)."""
        p = self.owner.parents
        return None if p is None else p.to(self.cache.device)

    def accept(self, num_inputs, path=None):
        """Commit the first ``num_inputs[b]`` (>= 0) tokens of the pending verify; after a tree
        verify, the tokens ``path[b, :num_inputs[b]]`` (int64 [b, W], a root path of the tree)."""
        slots = self.slots(self.batch, self.cache.device)
        self.cache.accept(slots, num_inputs.to(self.cache.device),
                          path=None if path is None else path.to(self.cache.device))
        full = self.pending_full
        self.pending_full = None
        if full is None:
            return
        hf = self.hf_ref()
        conv_state = hf.get_conv_state(self.layer_idx)
        S = conv_state.shape[-1]
        n = num_inputs.to(full.device).long()
        idx = n[:, None] + torch.arange(S, device=full.device)[None, :]
        if path is not None:  # committed order: the state's columns, then the accepted path
            order = torch.cat([torch.arange(S, device=full.device).expand(full.shape[0], S),
                               S + path.to(full.device).long().clamp(min=0)], 1)
            idx = torch.gather(order, 1, idx)
        idx = idx[:, None, :].expand(full.shape[0], full.shape[1], S)
        conv_state.copy_(torch.gather(full, 2, idx).to(conv_state.dtype))
        # the KV layers keep the positions some row committed: the longest acceptance
        _count_tokens(hf, self.layer_idx, n.max())
        self.dirty = True


class _Mamba2Adapter(_LayerAdapter):
    kind = "mamba2"

    def __init__(self, owner, module, family: Mamba2Family):
        super().__init__(owner, module)
        self.family = family
        self._validate()

    def _unsupported(self, attr, why):
        raise ReplaySSMUnsupported(f"{type(self.module).__name__} (layer {self.layer_idx}): {attr} {why}")

    def _validate(self):
        """Refuse, naming the attribute, any variant whose decode step this adapter would not reproduce."""
        m, fam = self.module, self.family
        for attr in ("num_heads", "head_dim", "ssm_state_size", "n_groups", "intermediate_size", "conv_dim",
                     "in_proj", "conv1d", "dt_bias", "A_log", "D", "norm", "out_proj", "activation"):
            if not hasattr(m, attr):
                self._unsupported(attr, "is missing")
        H, P, G, N = m.num_heads, m.head_dim, m.n_groups, m.ssm_state_size
        if H * P != m.intermediate_size:
            self._unsupported("head_dim", f"* num_heads = {H * P} != intermediate_size {m.intermediate_size}")
        if G < 1 or H % G:
            self._unsupported("n_groups", f"= {G} does not divide num_heads = {H}")
        if m.conv_dim != m.intermediate_size + 2 * G * N:
            self._unsupported("conv_dim", f"= {m.conv_dim} is not intermediate_size + 2 * n_groups * ssm_state_size")
        for attr in ("D", "A_log", "dt_bias"):  # per head; a per-channel D ([H * P]) is not supported
            shape = tuple(getattr(m, attr).shape)
            if shape != (H,):
                self._unsupported(attr, f"has shape {shape}; only one value per head ({H},) is supported")
        conv = m.conv1d
        if conv.groups != m.conv_dim or conv.in_channels != m.conv_dim or conv.out_channels != m.conv_dim:
            self._unsupported("conv1d", "is not a depthwise convolution over conv_dim channels")
        if m.activation is not None and m.activation not in ACT2FN:
            self._unsupported("activation", f"= {m.activation!r} is not an activation transformers knows")
        for attr in (fam.in_multiplier, fam.proj_multiplier, fam.norm_flag):
            if attr is not None and not hasattr(m, attr):
                self._unsupported(attr, "is missing")

    def _new_cache(self, num_slots, device):
        m, o = self.module, self.owner.options
        return Mamba2Cache(num_slots, m.num_heads, m.head_dim, m.ssm_state_size, ngroups=m.n_groups,
                           device=device, **o)

    def recurrence(self, slots, x, dt, A, B, C, z, verify):
        """The state-space step: ``rs.mamba2_decode`` (x [b, H, P], dt [b, H] raw, B, C [b, G, N],
        z [b, H, P] or None) or, verifying, ``rs.mamba2_verify`` (a T axis after b). Returns y fp32
        shaped as x."""
        m = self.module
        kw = dict(D=m.D, z=z, dt_bias=m.dt_bias, dt_softplus=True, backend=self.owner.backend)
        if verify:
            return mamba2_verify(self.cache, slots, x, dt, A, B, C, **kw, parents=self.tree_parents())
        self.dirty = True
        return mamba2_decode(self.cache, slots, x, dt, A, B, C, **kw)

    def run(self, hidden_states, hf_cache, verify):
        m, fam = self.module, self.family
        b, T, _ = hidden_states.shape
        dtype = hidden_states.dtype
        if fam.in_multiplier is not None:
            hidden_states = hidden_states * getattr(m, fam.in_multiplier)
        proj = m.in_proj(hidden_states)
        if fam.proj_multiplier is not None:
            proj = proj * getattr(m, fam.proj_multiplier)
        gate, xBC, dt = proj.split([m.intermediate_size, m.conv_dim, m.num_heads], dim=-1)
        xBC = self.conv(xBC.transpose(1, 2), hf_cache, verify).transpose(1, 2)
        x, B, C = torch.split(xBC, [m.intermediate_size, m.n_groups * m.ssm_state_size,
                                    m.n_groups * m.ssm_state_size], dim=-1)
        H, P, G, N = m.num_heads, m.head_dim, m.n_groups, m.ssm_state_size
        normed = fam.norm_flag is None or bool(getattr(m, fam.norm_flag))
        # with a gated RMSNorm the gate goes to the norm (the stock scan gets z=None); without one it is
        # the scan's z: y * silu(gate)
        lead = (b, T) if verify else (b,)
        z = None if normed else gate.reshape(*lead, H, P)
        A = -torch.exp(m.A_log.float())
        slots = self.slots(b, hidden_states.device)
        y = self.recurrence(slots, x.reshape(*lead, H, P), dt.reshape(*lead, H), A, B.reshape(*lead, G, N),
                            C.reshape(*lead, G, N), z, verify)
        y = y.reshape(b, T, -1).to(dtype)
        if normed:
            y = m.norm(y, gate)
        return m.out_proj(y.to(dtype))


class _GDNAdapter(_LayerAdapter):
    kind = "gdn"

    def _new_cache(self, num_slots, device):
        m, o = self.module, self.owner.options
        return GDNCache(num_slots, m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim,
                        device=device, **o)

    # transformers / fla keep the GDN state as [b, HV, K, V]; ReplaySSM as [b, HV, V, K]
    def _to_replay(self, hf_state):
        return hf_state.float().transpose(-1, -2)

    def _to_hf(self, state):
        return state.transpose(-1, -2)

    def _projections(self, hidden_states):
        """(mixed_qkv [b, T, conv_dim], z [b, T, HV, V], b [b, T, HV], a [b, T, HV])."""
        m = self.module
        bsz, T, _ = hidden_states.shape
        if hasattr(m, "in_proj_qkvz"):  # Qwen3-Next: fused, head-interleaved projections
            q, k, v, z, bb, a = m.fix_query_key_value_ordering(m.in_proj_qkvz(hidden_states),
                                                                m.in_proj_ba(hidden_states))
            mixed = torch.cat([t.reshape(bsz, T, -1) for t in (q, k, v)], dim=-1)
            return mixed, z, bb, a
        mixed = m.in_proj_qkv(hidden_states)  # Qwen3.5
        z = m.in_proj_z(hidden_states).reshape(bsz, T, -1, m.head_v_dim)
        return mixed, z, m.in_proj_b(hidden_states), m.in_proj_a(hidden_states)

    def recurrence(self, slots, q, k, v, g, beta, verify):
        """The state-space step on q, k [b, T, HK, K] (not normalized), v [b, T, HV, V], g fp32 and
        beta [b, T, HV]: ``rs.gdn_decode`` (T = 1) or, verifying, ``rs.gdn_verify``. Returns o fp32
        [b, T, HV, V]."""
        if verify:
            return gdn_verify(self.cache, slots, q, k, v, g, beta, use_qk_l2norm=True, backend=self.owner.backend,
                              parents=self.tree_parents())
        self.dirty = True
        return gdn_decode(self.cache, slots, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0],
                          use_qk_l2norm=True, backend=self.owner.backend)[:, None]

    def run(self, hidden_states, hf_cache, verify):
        m = self.module
        bsz, T, _ = hidden_states.shape
        mixed, z, bb, a = self._projections(hidden_states)
        mixed = self.conv(mixed.transpose(1, 2), hf_cache, verify).transpose(1, 2)
        q, k, v = torch.split(mixed, [m.key_dim, m.key_dim, m.value_dim], dim=-1)
        q = q.reshape(bsz, T, -1, m.head_k_dim)
        k = k.reshape(bsz, T, -1, m.head_k_dim)
        v = v.reshape(bsz, T, -1, m.head_v_dim)
        beta = bb.sigmoid()
        g = -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias)
        slots = self.slots(bsz, hidden_states.device)
        o = self.recurrence(slots, q, k, v, g, beta, verify)
        o = o.to(q.dtype).reshape(-1, m.head_v_dim)
        o = m.norm(o, z.reshape(-1, m.head_v_dim))
        return m.out_proj(o.reshape(bsz, T, -1))


class _KDAAdapter(_LayerAdapter):
    """``KimiLinearDeltaAttention``: one decode token is

        q, k, v = split(act(causal_conv(cat(q_proj(h), k_proj(h), v_proj(h)))))   [.., H, D] each
        g = forget_gate(h) = -exp(A_log) * softplus(f_b_proj(f_a_proj(h)) + dt_bias)   [.., H, D]
        beta = sigmoid(b_proj(h));  o = KDA(l2norm(q), l2norm(k), v, g, beta)  (scale D^-1/2)
        out = o_proj(o_norm(o, g_b_proj(g_a_proj(h))))   (RMSNorm gated by sigmoid)

    The gate is the layer's own ``forget_gate`` module, so its softplus (linear above 20) is
    transformers' own; ReplaySSM takes the per-channel log decay g it returns.
    """

    kind = "kda"

    def __init__(self, owner, module):
        super().__init__(owner, module)
        self._validate()

    def _unsupported(self, attr, why):
        raise ReplaySSMUnsupported(f"{type(self.module).__name__} (layer {self.layer_idx}): {attr} {why}")

    def _validate(self):
        """Refuse, naming the attribute, any variant whose decode step this adapter would not reproduce."""
        m = self.module
        for attr in ("num_heads", "head_dim", "qkv_dim", "conv_dim", "q_proj", "k_proj", "v_proj", "conv1d",
                     "forget_gate", "b_proj", "g_a_proj", "g_b_proj", "o_norm", "o_proj", "activation"):
            if not hasattr(m, attr):
                self._unsupported(attr, "is missing")
        H, D = m.num_heads, m.head_dim
        if m.qkv_dim != H * D:
            self._unsupported("qkv_dim", f"= {m.qkv_dim} is not num_heads * head_dim = {H * D}")
        if m.conv_dim != 3 * m.qkv_dim:
            self._unsupported("conv_dim", f"= {m.conv_dim} is not 3 * qkv_dim = {3 * m.qkv_dim}")
        conv = m.conv1d
        if conv.groups != m.conv_dim or conv.in_channels != m.conv_dim or conv.out_channels != m.conv_dim:
            self._unsupported("conv1d", "is not a depthwise convolution over conv_dim channels")
        if m.activation is not None and m.activation not in ACT2FN:
            self._unsupported("activation", f"= {m.activation!r} is not an activation transformers knows")
        for proj, width in (("q_proj", m.qkv_dim), ("k_proj", m.qkv_dim), ("v_proj", m.qkv_dim),
                            ("b_proj", H), ("g_b_proj", m.qkv_dim)):
            out = getattr(getattr(m, proj), "out_features", None)
            if out != width:
                self._unsupported(proj, f"has out_features = {out}; expected {width}")
        fg = m.forget_gate
        for attr in ("A_log", "dt_bias", "f_a_proj", "f_b_proj"):
            if not hasattr(fg, attr):
                self._unsupported(f"forget_gate.{attr}", "is missing")
        if fg.A_log.numel() != H or fg.A_log.shape[-2:] != (H, 1):
            self._unsupported("forget_gate.A_log", f"has shape {tuple(fg.A_log.shape)}; only one decay "
                                                   f"rate per head ([.., {H}, 1]) is supported")
        if tuple(fg.dt_bias.shape) != (m.qkv_dim,):
            self._unsupported("forget_gate.dt_bias", f"has shape {tuple(fg.dt_bias.shape)}; expected "
                                                     f"({m.qkv_dim},), one per key channel")
        if getattr(fg, "head_dim", D) != D or getattr(fg, "num_heads", H) != H:
            self._unsupported("forget_gate", "has a head geometry other than the layer's")
        if getattr(m.o_norm, "activation", "sigmoid") != "sigmoid":
            self._unsupported("o_norm.activation", f"= {m.o_norm.activation!r}; only 'sigmoid' is tested")

    def _new_cache(self, num_slots, device):
        m, o = self.module, self.owner.options
        return KDACache(num_slots, m.num_heads, m.num_heads, m.head_dim, m.head_dim, device=device, **o)

    # transformers / fla keep the KDA state as [b, H, K, V]; ReplaySSM as [b, HV, V, K]
    def _to_replay(self, hf_state):
        return hf_state.float().transpose(-1, -2)

    def _to_hf(self, state):
        return state.transpose(-1, -2)

    def recurrence(self, slots, q, k, v, g, beta, verify):
        """The state-space step on q, k [b, T, H, K] (not normalized), v [b, T, H, V], g fp32
        [b, T, H, K] (per-channel log decay) and beta [b, T, H]: ``rs.kda_decode`` (T = 1) or,
        verifying, ``rs.kda_verify``, on the patch's backend. Returns o fp32 [b, T, H, V]."""
        if verify:
            return kda_verify(self.cache, slots, q, k, v, g, beta, use_qk_l2norm=True, backend=self.owner.backend,
                              parents=self.tree_parents())
        self.dirty = True
        return kda_decode(self.cache, slots, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0],
                          use_qk_l2norm=True, backend=self.owner.backend)[:, None]

    def run(self, hidden_states, hf_cache, verify):
        m = self.module
        bsz, T, _ = hidden_states.shape
        shape = (bsz, T, m.num_heads, m.head_dim)
        mixed = torch.cat([m.q_proj(hidden_states), m.k_proj(hidden_states), m.v_proj(hidden_states)], dim=-1)
        mixed = self.conv(mixed.transpose(1, 2), hf_cache, verify).transpose(1, 2)
        q, k, v = (t.reshape(shape) for t in torch.split(mixed, [m.qkv_dim] * 3, dim=-1))
        g = m.forget_gate(hidden_states).float().reshape(shape)
        beta = torch.sigmoid(m.b_proj(hidden_states))
        slots = self.slots(bsz, hidden_states.device)
        o = self.recurrence(slots, q, k, v, g, beta, verify).to(q.dtype)
        gate = m.g_b_proj(m.g_a_proj(hidden_states)).reshape(shape)
        return m.o_proj(m.o_norm(o, gate).reshape(bsz, T, -1))


# ---------------------------------------------------------------------------------------------
# the patch
# ---------------------------------------------------------------------------------------------
class ReplayPatch:
    """A model whose state-space layers decode through ReplaySSM; undo with ``unpatch()`` (or use
    it as a context manager). Create with ``patch(model, ...)``."""

    def __init__(self, model, *, precision="s32_rs", window=16, max_draft=8, buffer_dtype=None,
                 seed=0, backend=None, check_values=True):
        if getattr(model, "_replayssm_patch", None) is not None:
            raise RuntimeError("this model is already patched by replayssm; unpatch it first")
        self.model = model
        self.options = dict(window=window, max_draft=max_draft, precision=precision,
                            buffer_dtype=buffer_dtype, seed=seed)
        self.backend = backend
        self.check_values = check_values
        self.mode = "decode"
        self.parents = None  # the draft tree of the verify in progress (int64 [b, T]) or None
        self.adapters: list[_LayerAdapter] = []
        mamba_cls, gdn_cls, kda_cls = _supported_classes()
        unknown = []
        for name, mod in model.named_modules():
            fam = mamba_cls.get(type(mod))
            if fam is None:
                fam = next((f for c, f in mamba_cls.items() if isinstance(mod, c)), None)
            if fam is not None:
                self.adapters.append(_Mamba2Adapter(self, mod, fam))
            elif gdn_cls and isinstance(mod, gdn_cls):
                self.adapters.append(_GDNAdapter(self, mod))
            elif kda_cls and isinstance(mod, kda_cls):
                self.adapters.append(_KDAAdapter(self, mod))
            elif _looks_recurrent(mod):
                unknown.append(f"{name} ({type(mod).__name__})")
        if unknown:
            raise ReplaySSMUnsupported(
                "ReplaySSM does not support these recurrent layers: " + ", ".join(unknown[:4])
                + (" ..." if len(unknown) > 4 else "") + ". Supported: "
                + ", ".join(n for n, _ in MAMBA2_MIXERS.values()) + ", " + ", ".join(GDN_LAYERS.values()) + ", "
                + ", ".join(KDA_LAYERS.values()) + ".")
        if not self.adapters:
            raise ReplaySSMUnsupported(
                f"{type(model).__name__} has no layer that ReplaySSM supports ({', '.join(SUPPORTED_MODELS)})")
        # validate the options once, on a 1-slot cache of the first layer (clear errors up front)
        self.adapters[0]._new_cache(1, "cpu")
        for ad in self.adapters:
            ad.module.forward = types.MethodType(lambda mod, *a, _ad=ad, **k: _ad.forward(*a, **k), ad.module)
        self._generate_patched = "generate" in vars(model)
        self._orig_generate = model.generate
        model.generate = self._checked_generate
        model._replayssm_patch = self
        self.active = True

    # -- generate guard --
    def _checked_generate(self, *args, **kwargs):
        gc = kwargs.get("generation_config") or getattr(self.model, "generation_config", None)
        def opt(name, default=None):
            if name in kwargs:
                return kwargs[name]
            return getattr(gc, name, default) if gc is not None else default
        if (opt("num_beams", 1) or 1) > 1:
            raise ReplaySSMUnsupported("beam search is not supported with ReplaySSM (the slots are not "
                                       "reordered); use num_beams=1")
        if opt("use_cache", True) is False:
            raise ReplaySSMUnsupported("generate(use_cache=False) recomputes every step without a cache, so "
                                       "there is nothing for ReplaySSM to decode; unpatch or use the cache")
        if opt("cache_implementation") not in (None, "dynamic"):
            raise ReplaySSMUnsupported(f"cache_implementation={opt('cache_implementation')!r} is not tested "
                                       "with ReplaySSM; use the default dynamic cache")
        if kwargs.get("assistant_model") is not None or opt("prompt_lookup_num_tokens") is not None:
            raise ReplaySSMUnsupported("HF assisted generation / prompt lookup crops recurrent caches, which "
                                       "ReplaySSM does not do: use replayssm.integrations.speculative."
                                       "speculative_generate")
        return self._orig_generate(*args, **kwargs)

    # -- speculative verify --
    @contextlib.contextmanager
    def verifying(self, parents=None):
        """Inside, a forward of T tokens verifies them (``*_verify``): nothing is committed until
        ``accept``. ``parents`` (int32/int64 [b, T], None: a chain): the fed tokens form a draft
        tree, parents[i, s] in [-1, s) the fed token that token s follows, -1 the last token the
        caches committed; the state-space layers get it as ``parents=`` and each causal
        convolution reads along the token's ancestors. (The attention layers need the matching
        tree attention mask from the caller.)"""
        if self.mode != "decode":
            raise RuntimeError("already verifying")
        if parents is not None:
            if not torch.is_tensor(parents) or parents.dim() != 2 or parents.dtype not in (torch.int32, torch.int64):
                raise ValueError("parents must be an int32 or int64 tensor [b, T]")
            parents = parents.to(torch.int64)
        self.mode, self.parents = "verify", parents
        try:
            yield self
        finally:
            self.mode, self.parents = "decode", None

    def accept(self, num_inputs, path=None):
        """Commit the first ``num_inputs[b]`` tokens of the last verify in every layer (SSM caches and
        convolution states); after a tree verify, ``path`` (int [b, W]) names them: the fed tokens
        path[b, :num_inputs[b]], a root path of the tree, in order. The caller reorders and crops
        the attention KV caches itself (by T - max(num_inputs)); the linear layers' token counts
        advance by max(num_inputs) here, so every layer then counts the same tokens."""
        if not torch.is_tensor(num_inputs):
            num_inputs = torch.tensor(num_inputs)
        num_inputs = num_inputs.reshape(-1).to(torch.int64)
        if path is not None:
            if not torch.is_tensor(path) or path.dim() != 2 or path.dtype not in (torch.int32, torch.int64):
                raise ValueError("path must be an int32 or int64 tensor [b, W]")
            path = path.to(torch.int64)
        for ad in self.adapters:
            ad.accept(num_inputs, path)

    # -- introspection --
    def caches(self):
        """{layer_idx: ReplaySSM cache} (allocated after the first prefill)."""
        return {ad.layer_idx: ad.cache for ad in self.adapters}

    def counters(self) -> dict:
        """{layer_idx: cache counters of the live slots}."""
        out = {}
        for ad in self.adapters:
            if ad.cache is not None:
                out[ad.layer_idx] = ad.cache.counters(ad.slots(ad.batch, ad.cache.device))
        return out

    def sync(self):
        """Write every layer's committed state back into the transformers cache it mirrors."""
        for ad in self.adapters:
            ad.sync_back()

    # -- undo --
    def unpatch(self):
        if not self.active:
            return
        self.sync()
        for ad in self.adapters:
            if "forward" in vars(ad.module):
                del ad.module.forward
            ad.cache = None
            ad.hf_ref = None
        if self._generate_patched:
            self.model.generate = self._orig_generate
        else:
            del self.model.generate
        self.model._replayssm_patch = None
        del self.model._replayssm_patch
        self.active = False

    close = unpatch

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.unpatch()
        return False


def patch(model, precision="s32_rs", window=16, max_draft=8, buffer_dtype=None, seed=0,
          backend=None, check_values=True) -> ReplayPatch:
    """Route the decode steps of ``model``'s state-space layers through ReplaySSM.

    precision: a preset name (see ``rs.PRESETS``); window: L, tokens between checkpoint writes;
    max_draft: the most tokens one verify may carry (``speculative_generate`` needs num_draft + 1);
    buffer_dtype: dtype of the replay buffer's large fields (None: the activations' dtype, stored exactly);
    seed: stochastic-rounding seed;
    backend: None (Triton on CUDA when available, else PyTorch), "torch" or "triton".
    check_values: run the value checks of every ReplaySSM decode, verify and accept (slot ids,
    pending verifies, accept counts, decays); they synchronize with the device, so turn them off
    to capture decode steps in a CUDA graph.
    Returns a ``ReplayPatch``; use it as a context manager or call ``unpatch()``.
    """
    return ReplayPatch(model, precision=precision, window=window, max_draft=max_draft,
                       buffer_dtype=buffer_dtype, seed=seed, backend=backend, check_values=check_values)


def unpatch(model) -> None:
    """Undo ``patch`` on ``model`` (no-op when it is not patched)."""
    p = getattr(model, "_replayssm_patch", None)
    if p is not None:
        p.unpatch()


def get_patch(model):
    """The active ``ReplayPatch`` of ``model`` or None."""
    return getattr(model, "_replayssm_patch", None)
