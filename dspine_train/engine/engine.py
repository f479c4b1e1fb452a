"""The speculative-decoding engine: a target, a DSpine draft, and the loop of METHOD 1 / 2.4.

One round for a batch of sequences, each with its own committed length:

    draft.propose(context cache, anchors)        -> d_1..d_P (the first g are verified)
    target([anchor, d_1..d_g]) in one forward    -> logits of g + 1 positions + context features
    accept (greedy prefix / rejection sampling)  -> a accepted drafts + 1 bonus token per sequence
    commit: target cache keeps anchor + d_1..d_a; the draft context gets their target features;
            the bonus token becomes the next anchor (its features arrive with the next verify).

P is the draft's predictions per block (`num_predictions`): Bk-1 for DSpine and DFlash, Bk for
a DSpark draft, whose anchor slot predicts too and whose Markov head decodes the block left to
right (`DSpineDraftModel.propose`); the round is the same either way.

With `tree_paths` M > 1 a round drafts and verifies a token tree instead of the chain (the top-M
paths through the draft's K x K lattice; `engine.tree_verify`), and commits the accepted path
exactly as above.

With `ngram` set, each round can also verify an n-gram branch (the continuation of the
sequence's last tokens where they stood before, `engine.ngram`), merged into the same tree
(`token_tree.hybrid_tree`); without a draft that branch alone is the proposal (the n-gram mode:
a chain as long as the proposal, a plain step where nothing matched, as prompt-lookup decoding).
With `adaptive`, each round's shape (plain step, n-gram only, draft, or both) is the one with
the most expected tokens per second under measured costs (`engine.round_planner`); what the
proposals scored persists across the engine's calls (`planner_memory`).

The acceptance result is read to the host once per round (the only sync of a step): it decides
stop strings, token budgets and the per-sequence bookkeeping. Plain decoding (`generate_ar`) is
the same machinery with one token per step, and is the baseline speculative output must equal.

This module holds the engine's state (target, draft, caches, compiled steps, settings); the loop
that drives it through a call is `engine.decode_loop`, its warm-up `engine.warmup`.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from dspine_train.chat_template import KWARGS_KEY, template_mismatch
from dspine_train.engine.chain_draft import (
    ChainDrafter,
    draft_predictions,
    serial_head,
)
from dspine_train.engine.cuda_graphs import StepCache
from dspine_train.engine.decode_loop import (
    GenerationResult,
    MaxNewTokens,
    OnTokens,
    Stops,
    check_call,
    run,
)
from dspine_train.engine.errors import CheckpointError, GenerationInputError
from dspine_train.engine.ngram import NgramConfig
from dspine_train.engine.prompts import Prompts
from dspine_train.engine.request_checks import tree_budget
from dspine_train.engine.round_planner import (
    PlannerMemory,
    RoundCosts,
    RoundShape,
    round_shapes,
)
from dspine_train.engine.round_results import AcceptanceReader
from dspine_train.engine.target_files import eos_token_ids, load_tokenizer
from dspine_train.engine.target_model import TargetModel
from dspine_train.engine.tree_verify import TreeVerifier
from dspine_train.engine.validation import check_draft_files, check_draft_fits_target
from dspine_train.engine.warmup import calibrate, warm_up
from dspine_train.engine.weights import load_target
from dspine_train.modeling.few_rows import FEW_ROWS, set_weight_first_rows


class Engine:
    """Target + optional draft with preallocated caches, ready to generate.

    Caches are sized once for `max_batch_size` sequences of up to `max_seq_len` positions
    (prompt + new tokens + one verified block). Without a draft only `generate_ar` works.

    Verify and draft steps attend over the live cache length rounded up to a multiple of
    `kv_bucket_size` (capped at the capacity), so their shapes take a few values only. On CUDA
    each step (verify, greedy and sampling draft, commit, the tree's draft and verify) is
    compiled (`compile`, default on for CUDA) and captured as a CUDA graph per (shape, kv
    bucket) (`cuda_graphs`), in one shared graph memory pool; `warmup` captures them ahead of
    timing. Steps that sample take their random draws as inputs, drawn just before from the
    call's generator. A failed compile/capture raises with `strict_graphs=True` and otherwise
    warns and runs that step eager. `compile_backend` is `torch.compile`'s backend ("eager"
    traces the steps without generating kernels).

    A DSpark draft (`method: dspark`) drafts `block_size` tokens a block (`num_predictions`),
    served as a chain only: `tree_paths` > 1 and `ngram` with it are refused by name. A DFlash2
    draft (`method: dflash2`) drafts `block_size - 1`, decoded by its candidate selector, and is
    served as a chain only too.

    `tree_paths` M > 1 verifies a token tree per round instead of the chain (see
    `engine.tree_verify`; lossless when greedy and when sampling): the top-M paths through the
    draft's K x K lattice, merged into at most `tree_nodes` N nodes (default M x g).
    `configure_tree` changes them later.

    `ngram` (an `NgramConfig`) adds an n-gram branch to every round's tree (hybrid rounds), or,
    without a draft, makes `generate` the n-gram mode (each round verifies the proposal found,
    no wider). `adaptive=True` lets each round verify
    the shape with the most expected tokens per second instead (`engine.round_planner`; its
    costs are measured by `calibrate`, which `warmup` runs); the output is the same either way.
    `configure_ngram` changes them later.

    `weight_first_rows` (CPU only): the target's linear layers multiply 2 to that many rows with
    the weight-first product (`modeling.few_rows`), which a CPU runs faster for a verify's few
    rows; None takes `FEW_ROWS` (16), 0 keeps `F.linear` everywhere.
    """

    def __init__(
        self,
        target: TargetModel,
        draft: Any | None = None,
        tokenizer: Any | None = None,
        *,
        max_batch_size: int = 8,
        max_seq_len: int | None = None,
        eos_token_ids: Sequence[int] | None = None,
        cuda_graphs: bool = True,
        compile: bool | None = None,
        strict_graphs: bool = False,
        kv_bucket_size: int = 256,
        compile_backend: str = "inductor",
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tree_paths: int = 1,
        tree_nodes: int | None = None,
        ngram: NgramConfig | None = None,
        adaptive: bool = False,
        weight_first_rows: int | None = None,
    ) -> None:
        if kv_bucket_size < 1:
            raise GenerationInputError(f"kv_bucket_size must be >= 1, got {kv_bucket_size}")
        self.target = target
        self.draft = draft
        self.tokenizer = tokenizer
        self.device = target.device
        self.max_batch_size = max_batch_size
        positions = target.config.max_position_embeddings
        if max_seq_len is not None and max_seq_len > positions:
            raise GenerationInputError(
                f"max_seq_len={max_seq_len} (CLI: --max-seq-len) exceeds the target's "
                f"max_position_embeddings={positions}: at most {positions}")
        self.max_seq_len = max_seq_len or min(positions, 4096)
        self.kv_bucket_size = kv_bucket_size
        self.eos_token_ids = list(eos_token_ids if eos_token_ids is not None else [])
        self.block_size = 1
        self.draft_cache: Any | None = None
        self._draft_caches: dict[int, Any] = {}
        # Text prompts render as the draft's training rows did (e.g. Qwen3's enable_thinking),
        # unless the caller says otherwise; a different template is warned about.
        recorded = getattr(draft.config, KWARGS_KEY, None) if draft is not None else None
        self.chat_template_kwargs = dict(
            chat_template_kwargs if chat_template_kwargs is not None else recorded or {}
        )
        self.num_predictions = 0  # drafts per block: block_size - 1, or block_size (DSpark)
        if draft is not None:
            check_draft_fits_target(draft.config, target, tokenizer)
            mismatch = template_mismatch(draft.config, tokenizer, self.chat_template_kwargs)
            if mismatch:
                warnings.warn(mismatch, stacklevel=2)
            self.block_size = int(draft.config.block_size)
            self.num_predictions = draft_predictions(draft.config)
            draft.to(device=self.device, dtype=target.dtype).eval()
            draft.bind_target(target.model.embed_tokens.weight, target.lm_head.weight)
            target.set_feature_layers(draft.config.target_layer_ids)
        target.setup(max_batch_size, self.max_seq_len)
        cuda = self.device.type == "cuda"
        if weight_first_rows is None:
            weight_first_rows = 0 if cuda else FEW_ROWS
        set_weight_first_rows(target, weight_first_rows)
        self._flat_verify = cuda  # a verify costs about the same for 1 or 30 tokens on a GPU
        use_graphs = cuda_graphs and cuda
        use_compile = cuda if compile is None else bool(compile)
        if use_compile:
            # a compiled variant per (shape, kv bucket) of each step; imported here, as the draft
            # is: the modeling package is not needed by plain decoding
            from dspine_train.modeling.compiled_flex import raise_recompile_limit

            raise_recompile_limit()
        pool = torch.cuda.graph_pool_handle() if use_graphs else None
        steps = dict(
            graphs=use_graphs,
            compile=use_compile,
            strict=strict_graphs,
            pool=pool,
            compile_backend=compile_backend,
        )
        self._target_step = StepCache(self._target_forward, "verify", **steps)
        self._chain = ChainDrafter(draft, lambda: self.draft_cache, steps)
        self._draft_step, self._draft_sample_step = self._chain.greedy_steps, self._chain.sample_steps
        self._commit_step = StepCache(self._commit, "commit", state=self._commit_state, **steps)
        self._tree = TreeVerifier(target, draft, lambda: self.draft_cache, steps)
        self.configure_tree(tree_paths, tree_nodes)
        self._costs: dict[tuple[int, int], RoundCosts] = {}  # (batch, g) -> measured costs
        self.configure_ngram(ngram, adaptive)
        # Per-round bookkeeping lives on the device, updated in place: the rows running at the
        # start of the round (`_active`) and those still running after it (`_running`).
        self._active = torch.zeros(max_batch_size, dtype=torch.bool, device=self.device)
        self._running = torch.zeros(max_batch_size, dtype=torch.bool, device=self.device)
        self._reader = AcceptanceReader(self.eos_token_ids, self.device)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(
        cls,
        target: str | Path,
        draft: str | Path | None = None,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        tokenizer: str | Path | Any | None = None,
        **kwargs: Any,
    ) -> Engine:
        """Load a target checkpoint directory and (optionally) an exported draft directory.

        The tokenizer defaults to the one saved with the target (none if it has none).
        Compatibility and file integrity are checked before anything runs.
        """
        target_dir = Path(target)
        if draft is not None:
            check_draft_files(draft)
        model = load_target(target_dir, device=device, dtype=dtype)
        tok = load_tokenizer(
            tokenizer if tokenizer is not None else target_dir, required=(tokenizer is not None)
        )
        draft_model = None
        if draft is not None:
            # Imported here: the modeling package pulls in transformers' model machinery, which
            # plain decoding does not need.
            from dspine_train.formats import load_draft

            try:  # strict load: missing, unexpected or mismatched weights are a ValueError
                draft_model = load_draft(draft)  # a DFlash checkpoint: a method-dflash draft
            except ValueError as err:  # its own errors name the directory; others get it
                message = str(err) if str(draft) in str(err) else f"draft {draft}: {err}"
                raise CheckpointError(message) from err
        kwargs.setdefault("eos_token_ids", eos_token_ids(target_dir, model, tok))
        return cls(model, draft_model, tok, **kwargs)

    # ------------------------------------------------------------------ public API
    def generate(
        self,
        prompts: Prompts,
        max_new_tokens: MaxNewTokens = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        chat: bool = True,
        *,
        stop: Stops = (),
        num_draft_tokens: int | None = None,
        seed: int = 0,
        on_tokens: OnTokens | None = None,
    ) -> GenerationResult:
        """Speculative decoding: lossless w.r.t. `generate_ar` with the same arguments.

        `num_draft_tokens` (g) is how many of the block's `num_predictions` proposals
        (`block_size - 1`; `block_size` for a DSpark draft) the target verifies per round;
        fewer can be faster where verifying is compute-bound (CPU).
        `max_new_tokens` and `stop` may be given per prompt (a list of ints; a list of lists of
        strings); `on_tokens(row, tokens)` sees each row's tokens as rounds commit them and
        may end the row by returning True (see `decode_loop.run`).
        """
        g = self._speculative_g(num_draft_tokens)
        return run(self, prompts, max_new_tokens, temperature, top_p, chat, stop, g, seed, True,
                   on_tokens)

    def generate_ar(
        self,
        prompts: Prompts,
        max_new_tokens: MaxNewTokens = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        chat: bool = True,
        *,
        stop: Stops = (),
        seed: int = 0,
        on_tokens: OnTokens | None = None,
    ) -> GenerationResult:
        """Plain autoregressive decoding with the same target and caches (the baseline)."""
        return run(self, prompts, max_new_tokens, temperature, top_p, chat, stop, 0, seed, False,
                   on_tokens)

    def check_request(
        self,
        prompt_ids: Sequence[Sequence[int]],
        max_new_tokens: MaxNewTokens,
        temperature: float = 0.0,
        top_p: float = 1.0,
        *,
        stop: Stops = (),
        speculative: bool = True,
        num_draft_tokens: int | None = None,
    ) -> None:
        """Raise `GenerationInputError` where `generate` (`speculative`) or `generate_ar` could
        not serve these token-id prompts with these settings; runs nothing (a server checks
        each request before batching it with others)."""
        g = self._speculative_g(num_draft_tokens) if speculative else 0
        check_call(self, prompt_ids, max_new_tokens, temperature, top_p, stop, g, speculative)

    def _speculative_g(self, num_draft_tokens: int | None) -> int:
        """g of a `generate` call; raises where the engine has nothing to propose with."""
        if self.draft is None and self.ngram is None:
            raise GenerationInputError(
                "this engine has no draft and no n-gram candidates (CLI: --ngram); use "
                "generate_ar")
        return self._num_draft_tokens(num_draft_tokens)

    def _num_draft_tokens(self, num_draft_tokens: int | None) -> int:
        """g: the draft tokens verified per round (0 without a draft)."""
        if self.draft is None:
            return 0
        top = self.num_predictions
        g = top if num_draft_tokens is None else int(num_draft_tokens)
        if not 1 <= g <= top:
            raise GenerationInputError(
                f"num_draft_tokens={g} must be in 1..{top} (the draft's predictions per block: "
                "block_size - 1, or block_size for a method: dspark draft or a domino draft "
                "with domino_shift_label)"
            )
        return g

    def configure_tree(self, paths: int = 1, nodes: int | None = None) -> None:
        """Verify trees of the top-`paths` lattice paths in at most `nodes` nodes per round
        (None: paths x g, every path whole); `paths=1` is the chain."""
        if paths < 1 or (nodes is not None and nodes < 1):
            raise GenerationInputError(
                f"tree_paths must be >= 1 and tree_nodes >= 1 (or None), got {paths}, {nodes}"
            )
        if paths > 1 and self.draft is None:
            raise GenerationInputError("tree_paths > 1 needs a draft")
        head = serial_head(self.draft)
        if paths > 1 and head is not None:
            raise GenerationInputError(
                f"tree_paths={paths} (CLI: --tree-paths): a method: {self.draft.config.method} "
                f"draft is served as a chain only ({head} decodes one path left to right; token "
                "trees are built from DSpine's transition lattice); use tree_paths=1")
        if paths == 1 and nodes is not None:  # a chain has no tree to size: not ignored
            raise GenerationInputError(
                f"tree_nodes={nodes} (CLI: --tree-nodes) sizes a token tree and needs "
                "tree_paths > 1 (CLI: --tree-paths); the chain verifies num_draft_tokens nodes")
        self.tree_paths, self.tree_nodes = int(paths), nodes

    def configure_ngram(self, ngram: NgramConfig | None, adaptive: bool = False) -> None:
        """N-gram candidates (None: none) and whether round shapes are chosen by measured cost,
        for the calls from now on."""
        head = serial_head(self.draft)
        if ngram is not None and head is not None:
            raise GenerationInputError(
                f"ngram (CLI: --ngram) with a method: {self.draft.config.method} draft: the "
                f"hybrid rounds merge the n-gram branch into a token tree, which {head} does not "
                "propose; serve it without --ngram (or the n-gram mode without a draft)")
        self.ngram, self.adaptive = ngram, bool(adaptive)
        self._costs.clear()  # measured for other shapes
        # What the proposals scored in earlier calls (`round_planner.PlannerMemory`).
        self.planner_memory = PlannerMemory()

    def _tree_budget(self, num_draft_tokens: int) -> int | None:
        """Nodes verified per round by a tree round, or None where the round is a chain."""
        if self.draft is None or self.tree_paths == 1 or num_draft_tokens == 0:
            return None
        config = self.draft.config
        width = getattr(config, "draft_vocab_size", None) or config.vocab_size
        k = min(int(config.candidate_k), int(width))
        return tree_budget(self.tree_paths, self.tree_nodes, k, num_draft_tokens)

    def round_shapes(self, num_draft_tokens: int) -> list[RoundShape]:
        """The shapes a round may take with g = `num_draft_tokens`, the widest (the one a
        non-adaptive engine always verifies) last: a plain step, the n-gram branch alone, the
        draft's chain or tree, and the draft with the n-gram branch merged in."""
        with_draft = self.draft is not None and num_draft_tokens > 0
        nodes = self._tree_budget(num_draft_tokens) if with_draft else None
        return round_shapes(self.ngram_widths(), num_draft_tokens if with_draft else 0, nodes)

    def ngram_widths(self) -> list[int] | None:
        """The widths of the n-gram-only chains a round may verify (None: no n-gram): every
        width up to `ngram.num_tokens` where a verify's cost grows with its tokens (a CPU),
        only the widest on a GPU (the verify is about flat there, and each width would be one
        more compiled and captured step per kv bucket)."""
        if self.ngram is None:
            return None
        widest = self.ngram.num_tokens
        return [widest] if self._flat_verify else list(range(1, widest + 1))

    def _depth(self, shape: RoundShape) -> int:
        """Drafted tokens on the longest path of a `shape` round."""
        if not shape.ngram:
            return shape.draft_depth
        branch = self.ngram.num_tokens if shape.drafts else shape.nodes  # merged: the whole one
        return max(shape.draft_depth, branch)

    def kv_buckets(self) -> list[int]:
        """Every kv length a verify step can attend over: multiples of `kv_bucket_size` below
        the capacity, then the capacity (`max_seq_len`)."""
        size = self.kv_bucket_size
        return [*range(size, self.max_seq_len, size), self.max_seq_len]

    def warmup(
        self,
        batch_sizes: Sequence[int] = (1,),
        num_draft_tokens: Sequence[int] | int | None = None,
        kv_buckets: Sequence[int] | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
    ) -> dict[str, float | int]:
        """Compile and capture every step at these shapes before anything is timed (and, with
        `adaptive`, measure the round costs); see `engine.warmup.warm_up`."""
        return warm_up(self, batch_sizes, num_draft_tokens, kv_buckets, temperature, top_p)

    def calibrate(self, batch: int, num_draft_tokens: int, repeats: int = 3) -> RoundCosts:
        """Seconds of one round of each round shape for `batch` sequences (cached per
        (batch, g)); see `engine.warmup.calibrate`."""
        return calibrate(self, batch, num_draft_tokens, repeats)

    # ------------------------------------------------------------------ steps (compiled, graphed)
    def _target_forward(
        self, block: torch.Tensor, kv_len: int
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Verify (or plain-decode) `block (B, T)`: the context features and float32 logits."""
        out = self.target(block, kv_len=kv_len)
        return out.features, self.target.logits(out.hidden)

    def _commit(
        self, num_accepted: torch.Tensor, features: torch.Tensor | None = None
    ) -> tuple[torch.Tensor]:
        """Commit a verified round on the device: each row that ran keeps its anchor and
        `num_accepted` drafts (target cache lengths, draft context features); rows done after
        the round (`_running` False) go back to length 0; `_active` becomes `_running`."""
        batch = num_accepted.shape[0]
        active, running = self._active[:batch], self._running[:batch]
        counts = (num_accepted + 1) * active  # (B,): anchor + accepted drafts of rows that ran
        lengths = torch.where(running, self.target.cache.lengths[:batch] + counts, 0)
        self.target.cache.crop(lengths)
        if features is not None:
            self.draft.append_context(self.draft_cache, features, counts)
            self.draft.crop_context(self.draft_cache, lengths)
        active.copy_(running)
        return (lengths,)

    def _commit_state(self) -> tuple[torch.Tensor, ...]:
        """What `_commit` updates in place (restored after its capture's warm-up runs)."""
        state = (self.target.cache.lengths, self._active)
        if self.draft_cache is not None:
            state += (self.draft_cache.lengths,)
        return state

    # ------------------------------------------------------------------ helpers
    def _bucket(self, needed: int, capacity: int) -> int:
        """`needed` kv slots rounded up to a multiple of `kv_bucket_size`, at most `capacity`."""
        size = self.kv_bucket_size
        return min(capacity, -(-needed // size) * size)

    def _draft_capacity(self) -> int:
        # The draft context cache holds max_seq_len committed positions plus one block.
        return self.max_seq_len + self.block_size

    def _draft_buckets(self, buckets: list[int]) -> list[int]:
        """The draft kv lengths reached when the verify steps use `buckets`."""
        capacity = self._draft_capacity()
        out = {min(b, capacity) for b in buckets if b >= self.block_size}
        if self.max_seq_len in buckets or not out:
            out.add(capacity)
        return sorted(out)

    def _steps(self) -> tuple[StepCache, ...]:
        return (
            self._target_step,
            self._draft_step,
            self._draft_sample_step,
            self._commit_step,
            *self._tree.steps,
        )

    def _capture_seconds(self) -> float:
        return sum(step.capture_s for step in self._steps())

    def _draft_cache_for(self, batch: int) -> Any:
        """The draft context cache for `batch` sequences, allocated on first use of that size."""
        cache = self._draft_caches.get(batch)
        if cache is None:
            # Normal tensors even when first met inside the loop's inference mode, so callers
            # (benchmarks, tests) can keep using the cache outside it.
            with torch.inference_mode(False):
                cache = self.draft.new_context_cache(
                    batch, self.max_seq_len, device=self.device, dtype=self.target.dtype
                )
            self._draft_caches[batch] = cache
        return cache
