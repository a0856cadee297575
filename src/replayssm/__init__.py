"""replayssm: decode state-space layers (Mamba-2, Gated DeltaNet, Kimi Delta Attention) from a
checkpoint written every L tokens plus a replay buffer of each token's small inputs, with
speculative verify, pointer-move rollback and a high-precision anchor kept apart from a
low-precision read copy.

Every public name is imported on first use, so that ``import replayssm`` (and ``replayssm --help``)
does not load torch until something needs it.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

#: public name -> submodule that defines it
_EXPORTS = {
    "poison_fresh_allocations": "cache",
    "FORMATS": "formats", "Format": "formats", "get_format": "formats",
    "GDNCache": "gdn.cache",
    "gdn_decode": "gdn.ops", "gdn_verify": "gdn.ops",
    "gdn_reference": "gdn.reference", "gdn_reference_step": "gdn.reference",
    "KDACache": "kda.cache",
    "kda_decode": "kda.ops", "kda_verify": "kda.ops",
    "kda_reference": "kda.reference", "kda_reference_step": "kda.reference",
    "Mamba2Cache": "mamba2.cache",
    "mamba2_decode": "mamba2.ops", "mamba2_verify": "mamba2.ops",
    "mamba2_reference": "mamba2.reference", "mamba2_reference_step": "mamba2.reference",
    "PRESETS": "precision", "REPRODUCTION_PRESETS": "precision", "Precision": "precision",
    "get_precision": "precision",
    # these import transformers
    "patch": "integrations.transformers", "unpatch": "integrations.transformers",
    "speculative_generate": "integrations.speculative",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        if not _EXPORTS[name].startswith("integrations."):
            globals()[name] = value  # later look-ups skip this function
        return value
    raise AttributeError(f"module 'replayssm' has no attribute {name!r}")


def __dir__():
    return __all__
