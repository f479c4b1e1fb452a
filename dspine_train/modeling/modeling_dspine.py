"""`DSpineDraftModel`: the DFlash block drafter with gated adjacent injection (METHOD 1-2.4).

Parameters (HF-style names): `fc` and `hidden_norm` fuse the target's context features,
`layers.*` are Qwen3-style decoder layers, `norm` is the final norm, `injection.*` holds the
readouts, message, gates and writes; a `method: dspark` draft adds `markov_head.*` and
`confidence_head.*` (`markov_head.py`), a `method: domino` draft `prefix_gru.*` and `embed_proj.*`
(`domino_head.py`), a `method: dflash2` draft `layers.N.{attention,mlp}_conv.*` and
`candidate_selector.*` (`dflash2_layers.py`, `candidate_selector.py`). The token table codes are a
persistent, non-trainable buffer. The target's frozen `embed_tokens` / `lm_head` weights are bound
with `bind_target` and are never parameters of the draft nor part of its checkpoint.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModel, PreTrainedModel
from transformers import initialization as init

from ..checkpoint_io import SafetensorsWeights
from .attention_masks import (
    default_use_flex,
    dense_training_mask,
    flex_training_mask,
    inference_block_mask,
)
from .candidate_selector import CandidateSelector
from .compiled_flex import check_flex_usable
from .configuration_dspine import DSpineConfig
from .context_cache import DraftContextCache
from .dflash2_layers import DFlash2DecoderLayer, GroupedDynamicCausalConv
from .domino_head import build_domino_head, init_domino_head
from .injection import AdjacentInjection
from .layer_stack import CachedContext, ProjectedContext, run_layer_stack
from .layers import DSpineDecoderLayer, DSpineRMSNorm, DSpineRotaryEmbedding, vocab_projection
from .markov_head import build_dspark_heads, init_dspark_heads
from .method_heads import MethodHeads
from .method_presets import SERIAL_HEAD_METHODS
from .transition_cache import (
    WalkResult,
    per_slot_decode,
    top_candidates,
    transition_table,
    walk_table,
)


@dataclass
class DSpineTrainOutput:
    """What the objective of METHOD 2.3 needs from one training forward (no vocabulary logits).

    hidden: (B, A, Bk, H) last layer output after its injection, before the final norm.
    pre_injection: (B, A, Bk, H) last layer output before its injection.
    recv_features: (B, A, Bk-1, r) last layer pre-injection features of slots 1..Bk-1.
    layer_features: N tensors (B, A, Bk-1, r), each layer's post-injection features.
    layer_hidden: N tensors (B, A, Bk, H) per-layer outputs after injection, only when asked
        (the `token_ce_intermediate` ablation needs them).
    labels: (B, A, P) the token each predicting slot targets, -100 past the sequence end: P =
        Bk-1 tokens at anchor + k (k = 1..Bk-1), or for DSpark P = Bk tokens at anchor + k + 1
        (k = 0..Bk-1).
    anchor_ids: (B, A) the anchor token of every block.
    prev_ids: (B, A, P) DSpark, Domino and DFlash2 only: the true token before each predicting
        slot's target (anchor + k for target k + 1), the Markov head's, the GRU's or the
        candidate selector's teacher-forced input (`dspark_block`, `domino_prev_states`); None
        for other methods.
    """

    hidden: torch.Tensor
    pre_injection: torch.Tensor
    recv_features: torch.Tensor
    layer_features: list[torch.Tensor]
    labels: torch.Tensor
    anchor_ids: torch.Tensor
    layer_hidden: list[torch.Tensor] = field(default_factory=list)
    prev_ids: torch.Tensor | None = None


@dataclass
class DraftProposal:
    """One drafted block per sequence.

    tokens: (B, P) draft tokens for positions anchor+1 .. anchor+P (P = `num_predictions`:
        Bk-1, or Bk for DSpark).
    q: (B, P, K) float32 distribution each token was sampled from, over that slot's
        `candidates`; None for greedy.
    candidates: (B, P, K) long target ids q is over (distinct per slot); None for greedy.
    """

    tokens: torch.Tensor
    q: torch.Tensor | None = None
    candidates: torch.Tensor | None = None


class DSpinePreTrainedModel(PreTrainedModel):
    """HF plumbing: config class, weight init (zero writes, identity-like norms)."""

    config_class = DSpineConfig
    config: DSpineConfig
    base_model_prefix = "dspine"
    main_input_name = "input_ids"
    _no_split_modules = ["DSpineDecoderLayer", "DFlash2DecoderLayer"]
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, DSpineRMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, GroupedDynamicCausalConv):
            # the identity (a DFlash layer); Linear's normal init above does not reach it (HF
            # initialises children first, then this module)
            identity = torch.zeros_like(module.base_kernel)
            identity[:, 0] = 1.0
            init.copy_(module.base_kernel, identity)
            init.zeros_(module.kernel_projection.weight)
        elif isinstance(module, CandidateSelector):
            init.normal_(module.predecessor_codebook, std=std)
            init.normal_(module.successor_codebook, std=std)
        elif isinstance(module, DSpineRotaryEmbedding):
            inv_freq, _ = module.compute_inv_freq(self.config)
            init.copy_(module.inv_freq, inv_freq)
        elif isinstance(module, DSpineDraftModel):
            # Runs after the children (HF initialises bottom-up). The writes and the predecessor
            # gate start at zero (METHOD 2.2), so an untrained DSpine is exactly its DFlash
            # backbone; `init_token_table` sets the codes and the readouts.
            injection = module.injection
            for write in injection.writes:
                init.zeros_(write.weight)
            init.zeros_(injection.gate_pred.weight)
            init.zeros_(module.token_codes)
            init_dspark_heads(module.markov_head, module.confidence_head, std)
            init_domino_head(module.prefix_gru)


class DSpineDraftModel(MethodHeads, DSpinePreTrainedModel):
    """The DSpine draft network (see the module docstring and `docs/ARCHITECTURE.md`)."""

    def __init__(self, config: DSpineConfig) -> None:
        super().__init__(config)
        n_ctx = config.num_context_layers
        self.fc = nn.Linear(n_ctx * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = DSpineRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        layer = DFlash2DecoderLayer if config.method == "dflash2" else DSpineDecoderLayer
        self.layers = nn.ModuleList(layer(config) for _ in range(config.num_layers))
        self.norm = DSpineRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = DSpineRotaryEmbedding(config)
        self.injection = AdjacentInjection(config)
        # DSpark's Markov and confidence heads (None for the other methods).
        self.markov_head, self.confidence_head = build_dspark_heads(config)
        # Domino's GRU and logit-delta MLP (None for the other methods).
        self.prefix_gru, self.embed_proj = build_domino_head(config)
        # DFlash2's candidate selector (None for the other methods).
        self.candidate_selector = None
        if config.method == "dflash2":
            self.candidate_selector = CandidateSelector(
                config.vocab_size, config.hidden_size, config.selector_rank,
                config.selector_top_k)
        # Token codes T (V, r) of the unified transfer space (METHOD 2.1); saved, never trained.
        self.register_buffer(
            "token_codes", torch.zeros(config.vocab_size, config.transfer_dim), persistent=True
        )
        if config.draft_vocab_size is not None:
            # Pruned vocabulary: draft id i scores target id i + d2t[i] (EAGLE-3's `d2t`
            # convention); saved with the weights, set by `set_draft_vocab`.
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long),
                                 persistent=True)
        self._target_embed: torch.Tensor | None = None
        self._target_head: torch.Tensor | None = None
        self._head_rows: tuple[tuple, torch.Tensor] | None = None  # (key, pruned head rows)
        self.post_init()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | os.PathLike, *args: Any,
                        **kwargs: Any) -> DSpineDraftModel:
        """Load an export strictly: safetensors only (a `.bin` would be unpickled), every
        config field present (`DSpineConfig.from_pretrained`), and missing, unexpected or
        mismatched weights are a `ValueError` naming them instead of a warning."""
        source = Path(str(pretrained_model_name_or_path))
        if source.is_dir() and not any(source.glob("*.safetensors")):
            pickled = sorted(p.name for p in source.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
            if pickled:
                raise ValueError(f"{source}: {', '.join(pickled)} is a pickled (.bin) draft; "
                                 "only safetensors drafts are loaded (convert it first)")
        if kwargs.pop("use_safetensors", True) is not True:
            raise ValueError("DSpineDraftModel.from_pretrained: safetensors only (use_safetensors)")
        if source.is_dir() and any(source.glob("*.safetensors")):
            # A truncated or corrupted file is a `WeightsError` naming it, as the engine and the
            # format readers report it, not safetensors' own error from deep inside transformers.
            with SafetensorsWeights(source) as weights:
                weights.check()
        want_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(pretrained_model_name_or_path, *args,
                                              use_safetensors=True, output_loading_info=True,
                                              **kwargs)
        problems = [f"{kind.replace('_', ' ')}: {', '.join(sorted(map(str, info[kind])))}"
                    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")
                    if info.get(kind)]
        problems += [str(msg) for msg in info.get("error_msgs") or []]
        if problems:
            raise ValueError(f"{source}: the weights do not match its config.json ("
                             + "; ".join(problems) + ")")
        return (model, info) if want_info else model

    # ------------------------------------------------------------------ target binding
    def bind_target(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        """Bind the target's frozen `embed_tokens.weight` and `lm_head.weight` (V, H).

        They are held as plain attributes: not parameters (never trained, never saved), and the
        very tensors of the target (no copy) unless the caller passes copies.
        """
        cfg = self.config
        for name, w in (("embed_weight", embed_weight), ("lm_head_weight", lm_head_weight)):
            if tuple(w.shape) != (cfg.vocab_size, cfg.hidden_size):
                raise ValueError(
                    f"{name} has shape {tuple(w.shape)}, the draft expects "
                    f"({cfg.vocab_size}, {cfg.hidden_size}) (vocab_size, hidden_size)"
                )
        self._target_embed = embed_weight.detach()
        self._target_head = lm_head_weight.detach()

    # ------------------------------------------------------------------ pruned vocabulary
    def set_draft_vocab(self, target_ids: torch.Tensor) -> None:
        """Score only `target_ids` (N distinct target ids, N = `draft_vocab_size`), kept sorted."""
        n = self.config.draft_vocab_size
        ids = torch.unique(target_ids.long().cpu())
        if n is None or ids.numel() != n or target_ids.numel() != n:
            raise ValueError(f"set_draft_vocab: {target_ids.numel()} ids ({ids.numel()} distinct)"
                             f" for draft_vocab_size={n}")
        if ids[0] < 0 or ids[-1] >= self.config.vocab_size:
            raise ValueError(f"set_draft_vocab: ids outside 0..{self.config.vocab_size - 1}")
        with torch.no_grad():
            self.d2t.copy_(ids - torch.arange(n))

    def draft_token_ids(self) -> torch.Tensor | None:
        """The target id of every draft row (N,), or None when the draft scores every id."""
        if self.config.draft_vocab_size is None:
            return None
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Target ids of draft ids (identity without a pruned vocabulary)."""
        return ids if self.config.draft_vocab_size is None else ids + self.d2t[ids]

    def target_to_draft(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft ids of target ids, -1 for ids outside the pruned vocabulary (identity without)."""
        rows = self.draft_token_ids()
        if rows is None:
            return ids
        t2d = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=ids.device)
        t2d[rows.to(ids.device)] = torch.arange(rows.numel(), device=ids.device)
        return t2d[ids.clamp_min(0)].masked_fill(ids < 0, -1)

    def output_head(self) -> torch.Tensor:
        """The head rows the draft scores: the target's lm_head, or its `d2t` rows (cached)."""
        _, head = self._require_target()
        rows = self.draft_token_ids()
        if rows is None:
            return head
        key = (head.data_ptr(), head.dtype, head.device, self.d2t._version, self.d2t.data_ptr())
        if self._head_rows is None or self._head_rows[0] != key:
            self._head_rows = (key, head[rows.to(head.device)])
        return self._head_rows[1]

    def _require_target(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._target_embed is None or self._target_head is None:
            raise RuntimeError("call bind_target(embed_weight, lm_head_weight) before running the draft")
        return self._target_embed, self._target_head

    def init_token_table(self, table) -> None:  # noqa: ANN001 - TokenTable, imported lazily
        """Load the token codes and start every readout at the table's directions.

        `readout_init: whitened`: R_l = diag(1/sqrt(eigenvalues)) directions^T, so at
        initialisation a hidden state's prediction feature is its (whitened) position in the
        transfer space (METHOD 2.1); `directions`: R_l = directions^T (SpecForge's init). The
        feature is normalised either way; the two differ in how each direction is weighted.
        """
        cfg = self.config
        if tuple(table.codes.shape) != (cfg.vocab_size, cfg.transfer_dim):
            raise ValueError(
                f"token table codes have shape {tuple(table.codes.shape)}, the draft expects "
                f"({cfg.vocab_size}, {cfg.transfer_dim}) (vocab_size, transfer_dim)"
            )
        with torch.no_grad():
            self.token_codes.copy_(table.codes.to(self.token_codes))
            readout = table.directions.T  # (r, H)
            if cfg.readout_init == "whitened":
                readout = (table.directions / table.eigenvalues.clamp_min(1e-12).sqrt()).T
            for layer_readout in self.injection.readouts:
                layer_readout.weight.copy_(readout.to(layer_readout.weight))

    # ------------------------------------------------------------------ shared pieces
    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The target's input embedding of `token_ids` (..., H), scaled as the target scales it
        (`embed_scale`: sqrt(H) for Gemma, in the weight's dtype as transformers does)."""
        embed, _ = self._require_target()
        hidden = F.embedding(token_ids, embed)
        if self.config.embed_scale != 1.0:
            hidden = hidden * torch.tensor(self.config.embed_scale, dtype=embed.dtype)
        return hidden

    def token_features(self, token_ids: torch.Tensor) -> torch.Tensor:
        """sqrt(r) * T[token]: a committed token's feature (..., r)."""
        return self.injection.scale * self.token_codes[token_ids]

    def fuse_context(self, context_features: torch.Tensor) -> torch.Tensor:
        """(B, T, n*H) concatenated target hidden states -> (B, T, H) context features."""
        expected = self.config.num_context_layers * self.config.hidden_size
        if context_features.shape[-1] != expected:
            raise ValueError(
                f"context_features last dim is {context_features.shape[-1]}, expected "
                f"{expected} = len(target_layer_ids) * hidden_size"
            )
        return self.hidden_norm(self.fc(context_features.to(self.fc.weight.dtype)))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + the target's lm_head: (..., H) -> (..., V), or (..., N) draft-id
        logits over a pruned vocabulary (`output_head`)."""
        return vocab_projection(self.norm(hidden), self.output_head().to(hidden.dtype))

    def target_logits(self, state: torch.Tensor) -> torch.Tensor:
        """The target's own logits from its final *normed* state: (..., H) -> (..., V).

        Only the bound head, no draft norm: the state is already through the target's final norm.
        """
        _, head = self._require_target()
        return F.linear(state, head.to(state.dtype))

    def refined_scores(
        self,
        pre: torch.Tensor,
        recv: torch.Tensor,
        pred_ids: torch.Tensor,
        cand_ids: torch.Tensor,
    ) -> torch.Tensor:
        """Refined scores S[c, c'] of METHOD 2.4 ("last-write refinement").

        pre (..., H) last layer pre-injection state, recv (..., r) its feature, pred_ids (..., P)
        predecessor tokens c, cand_ids (..., K) candidates c' -> (..., P, K). Only the K head rows
        of the candidates are gathered, never the vocabulary.
        """
        _, head = self._require_target()
        f_pred = self.token_features(pred_ids).to(pre.dtype)  # (..., P, r)
        if self.config.injection:
            h = self.injection.write(
                self.config.num_layers - 1, pre[..., None, :], recv[..., None, :], f_pred
            )  # (..., P, H)
        else:
            h = pre[..., None, :].expand(*f_pred.shape[:-1], pre.shape[-1])
        rows = head[cand_ids].to(pre.dtype)  # (..., K, H)
        return torch.matmul(self.norm(h), rows.transpose(-1, -2))  # (..., P, K)

    # ------------------------------------------------------------------ training forward
    def forward(
        self,
        input_ids: torch.Tensor,
        context_features: torch.Tensor,
        anchors: torch.Tensor,
        anchor_mask: torch.Tensor | None = None,
        replace_mask: torch.Tensor | None = None,
        use_flex: bool | None = None,
        return_layer_hidden: bool | None = None,
    ) -> DSpineTrainOutput:
        """All anchors of a batch in one pass (METHOD 1 "Training", 2.2).

        input_ids (B, S); context_features (B, S, n*H); anchors (B, A) with padding anchors
        marked False in anchor_mask (B, A); replace_mask (B, A) selects the blocks whose first
        `replacement_layers` layers hear the true predecessor's code. `use_flex` defaults to
        compiled flex attention on CUDA and a dense SDPA mask elsewhere; `use_flex=True` on CPU
        runs compiled flex too (forward only: torch has no CPU flex backward). When compiled
        flex attention cannot run, `FlexAttentionUnavailable` (a RuntimeError) says why; it never
        falls back to a dense path.
        """
        cfg = self.config
        self._require_target()
        bsz, seq_len = input_ids.shape
        num_blocks, bk = anchors.shape[1], cfg.block_size
        if anchor_mask is not None:
            anchors = torch.where(anchor_mask, anchors, torch.zeros_like(anchors))
        # A DSpark block also targets the token after its last slot (a + Bk).
        span = bk + 1 if cfg.anchor_predicts else bk
        offsets = torch.arange(span, device=input_ids.device)
        spanned = anchors[:, :, None] + offsets  # (B, A, span)
        in_seq = spanned < seq_len
        gathered = torch.gather(input_ids, 1, spanned.clamp_max(seq_len - 1).view(bsz, -1))
        gathered = gathered.view(bsz, num_blocks, span)  # (B, A, span) tokens at a+k
        labels = torch.where(in_seq, gathered, torch.full_like(gathered, -100))[..., 1:]
        # the heads that read the token before each slot (DSpark's, Domino's, DFlash2's)
        with_prev = cfg.method in SERIAL_HEAD_METHODS
        prev_ids = gathered[..., :cfg.num_predictions] if with_prev else None  # (B, A, P)
        # the block's own slots
        gathered, positions = gathered[..., :bk], spanned[..., :bk].contiguous()
        anchor_ids = gathered[..., 0]  # (B, A)

        block_ids = torch.full_like(gathered, cfg.mask_token_id)
        block_ids[..., 0] = anchor_ids
        dtype = self.fc.weight.dtype
        hidden = self.embed_tokens(block_ids).to(dtype).view(bsz, num_blocks * bk, -1)

        ctx = self.fuse_context(context_features)  # (B, S, H)
        ctx_pos = torch.arange(seq_len, device=input_ids.device).expand(bsz, -1)
        ctx_cos, ctx_sin = self.rotary_emb(ctx_pos, dtype)
        blk_cos, blk_sin = self.rotary_emb(positions.view(bsz, -1), dtype)
        if use_flex is None:
            use_flex = default_use_flex(input_ids.device)
        if use_flex:
            needs_grad = torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters())
            check_flex_usable(input_ids.device, needs_grad)
        causal = cfg.block_attention == "causal"
        build_mask = flex_training_mask if use_flex else dense_training_mask
        mask = build_mask(anchors, seq_len, bk, causal, cfg.sliding_window)

        anchor_codes = self.token_features(anchor_ids).to(dtype)  # (B, A, r)
        true_pred_codes = None
        if replace_mask is not None and cfg.injection:
            # true predecessor of slot t is the token at a + t - 1 (t = 1..Bk-1)
            true_pred_codes = self.token_features(gathered[..., :-1]).to(dtype)  # (B, A, Bk-1, r)
        if return_layer_hidden is None:
            return_layer_hidden = cfg.token_ce_intermediate

        stack = run_layer_stack(
            self.layers, self.injection, cfg, hidden, blk_cos, blk_sin,
            ProjectedContext(ctx, ctx_cos, ctx_sin, mask), anchor_codes,
            true_pred_codes=true_pred_codes, replace_mask=replace_mask,
            return_layer_features=True, return_layer_hidden=return_layer_hidden,
        )
        return DSpineTrainOutput(
            hidden=stack.hidden,
            pre_injection=stack.pre_injection,
            recv_features=stack.recv_features,
            layer_features=stack.layer_features,
            labels=labels,
            anchor_ids=anchor_ids,
            layer_hidden=stack.layer_hidden,
            prev_ids=prev_ids,
        )

    # ------------------------------------------------------------------ decoding
    def walk(
        self,
        pre_injection: torch.Tensor,
        recv_features: torch.Tensor,
        slot_logits: torch.Tensor,
        anchor_ids: torch.Tensor,
        temperature: float | torch.Tensor = 0.0,
        generator: torch.Generator | None = None,
        noise: torch.Tensor | None = None,
    ) -> WalkResult:
        """Decode drafted tokens from one forward's outputs (METHOD 2.4).

        pre_injection (..., Bk, H), recv_features (..., Bk-1, r), slot_logits (..., Bk-1, V),
        anchor_ids (...,). With `transition_cache` the K x K table walk, else per-slot decode
        (sampling from each slot's top-K). Sampling (`temperature > 0`, or `noise` given) draws
        with the engine's exponential race over `noise (..., Bk-1, K)` Exp(1) draws, from
        `generator` when not given; with `noise` the walk is a pure function of tensors and
        `temperature` may be a tensor. With a pruned vocabulary, slot_logits are over draft ids
        and this is the one place they become target ids: the tokens and candidates returned
        are target ids.
        """
        k = self.num_candidates
        if not self.config.transition_cache:
            result = per_slot_decode(slot_logits, k, temperature, generator, noise)
            if self.config.draft_vocab_size is None:
                return result
            cand = result.candidates
            return WalkResult(
                self.draft_to_target(result.tokens),
                result.q,
                None if cand is None else self.draft_to_target(cand),
            )
        cand = self.draft_to_target(top_candidates(slot_logits, k))
        table = transition_table(
            self.refined_scores, pre_injection[..., 1:, :], recv_features, anchor_ids, cand
        )
        return walk_table(table, cand, temperature, generator, noise)

    @property
    def num_candidates(self) -> int:
        """K: the candidates per slot a sampling walk draws among (the last axis of q): DFlash2's
        `selector_top_k`, else `candidate_k`."""
        if self.candidate_selector is not None:
            return int(self.config.selector_top_k)
        return int(self.config.candidate_k)

    def new_context_cache(
        self,
        batch_size: int,
        max_length: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> DraftContextCache:
        """Allocate the static context K/V cache for `max_length` committed positions."""
        cfg = self.config
        return DraftContextCache.allocate(
            num_layers=cfg.num_layers,
            batch_size=batch_size,
            max_length=max_length,
            block_size=cfg.block_size,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            device=device if device is not None else self.fc.weight.device,
            dtype=dtype or self.fc.weight.dtype,
        )

    @torch.no_grad()
    def append_context(
        self, cache: DraftContextCache, features: torch.Tensor, counts: torch.Tensor
    ) -> None:
        """Commit target features (B, T, n*H), the first counts[b] rows of each sequence."""
        ctx = self.fuse_context(features)  # (B, T, H)
        t = ctx.shape[1]
        pos = cache.lengths[:, None] + torch.arange(t, device=ctx.device)  # (B, T)
        cos, sin = self.rotary_emb(pos, ctx.dtype)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.project_kv(ctx, cos, sin)
            cache.write(i, cache.lengths, k, v)
        cache.advance(counts.to(cache.lengths.device))

    def crop_context(self, cache: DraftContextCache, lengths: torch.Tensor) -> None:
        """Drop committed context beyond `lengths` (B,)."""
        cache.crop(lengths)

    @torch.no_grad()
    def draft_forward(
        self, cache: DraftContextCache, anchor_ids: torch.Tensor, kv_len: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One block per sequence over the cached context.

        Returns slot logits (B, P, V), last-layer pre-injection states (B, Bk, H) and
        features (B, Bk-1, r): P = Bk-1 drafted slots, or for DSpark P = Bk base logits (no
        Markov term, which depends on the tokens drafted before each slot: `dspark_block`).
        The block's K/V are written after the committed context.
        `kv_len` bounds the cache slots attended to: any value >= every `lengths[b] + Bk`
        (the engine rounds it up to a bucket); the default is the whole cache.
        """
        cfg = self.config
        self._require_target()
        bsz, bk = anchor_ids.shape[0], cfg.block_size
        dtype = self.fc.weight.dtype
        block_ids = torch.full((bsz, bk), cfg.mask_token_id, dtype=torch.long, device=anchor_ids.device)
        block_ids[:, 0] = anchor_ids
        hidden = self.embed_tokens(block_ids).to(dtype)  # (B, Bk, H)
        pos = cache.lengths[:, None] + torch.arange(bk, device=anchor_ids.device)  # (B, Bk)
        cos, sin = self.rotary_emb(pos, dtype)
        kv_len = cache.capacity if kv_len is None else min(kv_len, cache.capacity)
        mask = inference_block_mask(cache.lengths, kv_len, bk, cfg.block_attention == "causal",
                                    cfg.sliding_window)
        anchor_codes = self.token_features(anchor_ids).to(dtype)  # (B, r)
        stack = run_layer_stack(
            self.layers, self.injection, cfg, hidden, cos, sin,
            CachedContext(cache, kv_len, mask), anchor_codes,
        )
        first = 0 if cfg.anchor_predicts else 1
        return self.logits(stack.hidden[:, first:]), stack.pre_injection, stack.recv_features

    @torch.no_grad()
    def propose(
        self,
        cache: DraftContextCache,
        anchor_ids: torch.Tensor,
        temperature: float | torch.Tensor = 0.0,
        generator: torch.Generator | None = None,
        kv_len: int | None = None,
        noise: torch.Tensor | None = None,
    ) -> DraftProposal:
        """Draft one block per sequence after its committed context; anchor_ids (B,).

        P = `config.num_predictions` tokens: Bk-1 (DSpine, DFlash: `walk`; DFlash2: its
        candidate selector's left-to-right walk, `dflash2_walk`), or Bk for a DSpark draft,
        decoded left to right by its Markov head (`dspark_walk`); a left-to-right walk's q is
        the softmax each slot drew from given the token drafted before it. `kv_len` bounds the context
        slots attended to (see `draft_forward`). Sampling as in `walk`: `noise (B, P, K)` makes
        it a pure function of tensors (the engine's compiled, captured sampling step).
        """
        slot_logits, pre, recv = self.draft_forward(cache, anchor_ids, kv_len)
        if self.config.method == "domino":  # no injection: `pre` is the last layer's output
            first = 0 if self.config.anchor_predicts else 1
            result = self.domino_walk(slot_logits, pre[:, first:], anchor_ids, temperature,
                                      generator, noise)
            return DraftProposal(tokens=result.tokens, q=result.q, candidates=result.candidates)
        if self.config.anchor_predicts:
            result = self.dspark_walk(slot_logits, anchor_ids, temperature, generator, noise)
            return DraftProposal(tokens=result.tokens, q=result.q, candidates=result.candidates)
        if self.candidate_selector is not None:
            result = self.dflash2_walk(slot_logits, pre[:, 1:], anchor_ids, temperature,
                                       generator, noise)
            return DraftProposal(tokens=result.tokens, q=result.q, candidates=result.candidates)
        result = self.walk(pre, recv, slot_logits, anchor_ids, temperature, generator, noise)
        return DraftProposal(tokens=result.tokens, q=result.q, candidates=result.candidates)


# Any import of the model registers its type, so `AutoConfig` / `AutoModel.from_pretrained` read
# a saved draft once the model is loaded (the package's names load it: see `__init__`).
AutoConfig.register("dspine", DSpineConfig, exist_ok=True)
AutoModel.register(DSpineConfig, DSpineDraftModel, exist_ok=True)
