"""Integrations of replayssm with model libraries (optional extras).

- ``replayssm.integrations.transformers``: ``patch`` a loaded Hugging Face causal LM with Mamba-2
  layers (``Mamba2ForCausalLM``, Nemotron-H, FalconH1, Bamba, GraniteMoeHybrid, Zamba2) or Gated
  DeltaNet layers (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) so that its decode steps run through ReplaySSM.
- ``replayssm.integrations.speculative``: batched ``speculative_generate`` (draft, verify, accept
  per row) with chain or tree drafters: n-gram (prompt lookup), a draft model (greedy chain or
  top-k tree), or any callable.
- ``replayssm.integrations.evalkl``: teacher-forced KL / log-prob agreement of the precision presets.

Importing this package does not import transformers; the submodules do.
"""
