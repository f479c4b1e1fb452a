"""What each draft `method` fixes: the settings of DSpine, DFlash, DSpark, Domino and DFlash2
(METHOD 2.5).

Plain data, read by `DSpineConfig.apply_method`, the formats and the training config.
"""

from __future__ import annotations

from typing import Any

# What each `method` fixes (METHOD 1, 2.5). `dflash` is the reference DFlash network
# and decode (z-lab's `DFlashDraftModel`): no injection, bidirectional attention inside the block,
# each slot decoded by its own argmax, and none of DSpine's extra training terms. `dspark` is
# DeepSpec's DSpark: the same backbone, but the anchor slot predicts too (B predictions, slot k
# predicts token a+k+1), plus a Markov head and a confidence head (`markov_head.py`). A field
# left unset (None) takes its method's value; a method refuses any other value for the fields
# it fixes (`METHOD_FREE_FIELDS` lists the ones it leaves open; see `apply_method`).
_DSPARK_OFF = {"markov_rank": 0, "markov_head_type": "vanilla",
               "enable_confidence_head": False, "confidence_head_with_markov": False}
# Domino's GRU logit correction (`domino_head.py`); off for every other method.
_DOMINO_OFF = {"domino_emb_dim": 0, "domino_gru_hidden_dim": 0, "domino_prefix_len": 0,
               "domino_shift_label": False}
# DFlash2 (z-lab): grouped dynamic causal convolutions around each layer's attention and MLP,
# and a rank-r candidate selector over each slot's top-k (`dflash2_layers.py`,
# `candidate_selector.py`); off (0) for the other methods.
_DFLASH2_OFF = {"conv_kernel_size": 0, "conv_group_size": 0, "selector_rank": 0,
                "selector_top_k": 0}
_PLAIN_BACKBONE = {"injection": False, "block_attention": "bidirectional",
                   "transition_cache": False, "refine_weight": 0.0, "alignment_weight": 0.0,
                   "token_ce_intermediate": False}
METHOD_PRESETS: dict[str, dict[str, Any]] = {
    "dspine": {
        "injection": True,
        "block_attention": "causal",
        "transition_cache": True,
        "refine_weight": 1.0,
        "alignment_weight": 0.5,
        "token_ce_intermediate": False,
        **_DSPARK_OFF,
        **_DOMINO_OFF,
        **_DFLASH2_OFF,
    },
    "dflash": {**_PLAIN_BACKBONE, **_DSPARK_OFF, **_DOMINO_OFF, **_DFLASH2_OFF},
    # DeepSpec's published DSpark: rank-256 first-order ("vanilla") Markov head, confidence head
    # on [hidden ; W1[previous token]].
    "dspark": {**_PLAIN_BACKBONE, "markov_rank": 256, "markov_head_type": "vanilla",
               "enable_confidence_head": True, "confidence_head_with_markov": True,
               **_DOMINO_OFF, **_DFLASH2_OFF},
    # SpecForge's Domino: the DFlash backbone plus a GRU over the block's previous tokens and a
    # logit-delta MLP (SpecForge's defaults: 256-wide MLP, GRU hidden 1024, no pure-draft
    # prefix, same-position labels; its published Qwen3-8B draft shifts the labels).
    "domino": {**_PLAIN_BACKBONE, **_DSPARK_OFF, **_DFLASH2_OFF, "domino_emb_dim": 256,
               "domino_gru_hidden_dim": 1024, "domino_prefix_len": 0,
               "domino_shift_label": False},
    # z-lab's published DFlash2: kernel 2, groups of 16 channels, a rank-256 selector over the
    # top 16 candidates of each slot; DFlash's layout (the anchor given, B-1 predictions).
    "dflash2": {**_PLAIN_BACKBONE, **_DSPARK_OFF, **_DOMINO_OFF, "conv_kernel_size": 2,
                "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16},
}
# The preset fields each method leaves open (DSpine's ablation switches; DSpark's head
# settings); every other preset field is fixed by the method.
METHOD_FREE_FIELDS: dict[str, tuple[str, ...]] = {
    "dspine": ("injection", "block_attention", "transition_cache", "refine_weight",
               "alignment_weight", "token_ce_intermediate"),
    "dflash": (),
    "dspark": tuple(_DSPARK_OFF),
    "domino": tuple(_DOMINO_OFF),
    "dflash2": tuple(_DFLASH2_OFF),
}
# Methods whose anchor slot is itself a prediction (slot k predicts token a+k+1); a Domino draft
# with `domino_shift_label` is one too (`DSpineConfig.anchor_predicts`).
ANCHOR_PREDICTING_METHODS = ("dspark",)
# Methods whose drafts are decoded left to right (a head reads the tokens drafted before each
# slot): served as a chain only (no token trees, no n-gram hybrid).
SERIAL_HEAD_METHODS = ("dspark", "domino", "dflash2")
DOMINO_METHOD = "domino"
