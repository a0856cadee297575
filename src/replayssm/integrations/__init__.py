"""Integrations of replayssm with model libraries (optional extras).

- ``replayssm.integrations.transformers``: ``patch`` a loaded Hugging Face ``Mamba2ForCausalLM`` or
  Qwen3.5 / Qwen3-Next (Gated DeltaNet) causal LM so that its decode steps run through ReplaySSM.
- ``replayssm.integrations.speculative``: ``speculative_generate`` (draft, verify, accept) with an
  n-gram (prompt-lookup) drafter or any callable drafter.
- ``replayssm.integrations.evalkl``: teacher-forced KL / log-prob agreement of the precision presets.

Importing this package does not import transformers; the submodules do.
"""
