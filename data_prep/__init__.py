"""Data preparation for DSpine drafts (METHOD section 3): prompts -> target answers -> masks.

Stages, each a module with a CLI:

* :mod:`data_prep.default_target`  assemble the embedded Qwen2.5-Coder-0.5B-Instruct target;
* :mod:`data_prep.regenerate`      regenerate assistant turns with the target (local / HTTP);
* :mod:`data_prep.tokenize`        chat template + loss masks -> Arrow train/eval datasets.

Supporting modules: :mod:`~data_prep.schema` (the normalised row), :mod:`~data_prep.readers`
(input formats), :mod:`~data_prep.sources` (packaged prompt sets, stable subsets and splits),
:mod:`~data_prep.loss_mask`, :mod:`~data_prep.shards`, :mod:`~data_prep.config` (Hydra
schema) and :mod:`~data_prep.backends`.
"""
