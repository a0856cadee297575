"""replayssm: decode state-space layers (Mamba-2, Gated DeltaNet) from a checkpoint written every
L tokens plus a replay buffer of each token's small inputs, with speculative verify, pointer-move
rollback and a high-precision anchor kept apart from a low-precision read copy."""
from .cache import poison_fresh_allocations
from .formats import FORMATS, Format, get_format
from .gdn.cache import GDNCache
from .gdn.ops import gdn_decode, gdn_verify
from .gdn.reference import gdn_reference, gdn_reference_step
from .mamba2.cache import Mamba2Cache
from .mamba2.ops import mamba2_decode, mamba2_verify
from .mamba2.reference import mamba2_reference, mamba2_reference_step
from .precision import PRESETS, SEED_PRESETS, Precision, get_precision

__version__ = "0.1.0"

_LAZY = {"patch": "integrations.transformers", "unpatch": "integrations.transformers",
         "speculative_generate": "integrations.speculative"}


def __getattr__(name):
    """``rs.patch``, ``rs.unpatch``, ``rs.speculative_generate`` import transformers on first use."""
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'replayssm' has no attribute {name!r}")

__all__ = [
    "FORMATS", "Format", "GDNCache", "Mamba2Cache", "PRESETS", "Precision", "SEED_PRESETS",
    "gdn_decode", "gdn_reference", "gdn_reference_step", "gdn_verify", "get_format",
    "get_precision", "mamba2_decode", "mamba2_reference", "mamba2_reference_step",
    "mamba2_verify", "patch", "poison_fresh_allocations", "speculative_generate", "unpatch",
    "__version__",
]
