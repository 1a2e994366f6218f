"""The tiny model factory, by responsibility (import it through :mod:`..tiny_models`).

configs (archs, constants, config per arch), tokenizer (BPE on an in-code corpus), weights
(per-name seeded init), kimi (Kimi-K2.5 checkpoint: remote code, vision tower), quantize (W4A16 as
released), build (:func:`build.build_tiny_model` and its cache), support (vLLM kwargs/env/limits).
Importing it does not import torch or transformers.
"""
