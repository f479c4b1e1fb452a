"""Section 6 of the GPU check: the engine's memory, and one training step against the memory plan."""

from __future__ import annotations

import time
from typing import Any

import torch
import transformers

from scripts.tools.gpu_check.context import (
    GIB,
    REPO,
    Check,
    Figures,
    free_device_memory,
    max_memory,
    memory_allocated,
    reset_peak,
    sync,
)


def section_memory(ck: Check, fig: Figures) -> None:
    if ck.cuda:
        timing = ck.timing_engine()
        fig["engine"] = dict(target_weights_gib=timing["target_weights_gib"],
                             after_setup=timing["setup"], after_capture=timing["captured"])
    else:
        fig["engine"] = "not measurable on CPU (no allocator counters)"
    fig["training_step"] = training_step_memory(ck)
    step = fig["training_step"]
    if ck.cuda:
        fig.expect(step["measured_gib"] <= step["predicted_gib"] / (1 - step["headroom"]),
                   f"training step peak {step['measured_gib']:.2f} GiB exceeds the plan's "
                   f"{step['predicted_gib']:.2f} GiB plus its {step['headroom']:.0%} headroom")


def recipe_config(recipe: str):  # noqa: ANN201 - TrainConfig
    """The composed recipe at world size 1 (everything on this one device)."""
    from dspine_train.training.config import compose_train_config

    return compose_train_config(f"recipe={recipe}", "world_size=1")


def recipe_draft(recipe: str) -> tuple[Any, Any, Any]:
    """The recipe's config, its target's config and the draft `plan_only` sizes for it.

    `tiny` uses the tiny random target's architecture; `qwen3_8b` the shipped Qwen3-8B config
    (no tokenizer here: `plan_draft_config` then takes a placeholder mask id, which changes no
    memory).
    """
    from dspine_train.training.memory_plan.for_recipe import plan_draft_config
    from dspine_train.training.tiny_assets import tiny_target_config

    config = recipe_config(recipe)
    target_config = tiny_target_config() if recipe == "tiny" else transformers.AutoConfig.from_pretrained(
        REPO / "recipes/targets/qwen3_8b")
    return config, target_config, plan_draft_config(config, target_config)


def training_step_memory(ck: Check) -> dict[str, Any]:
    """One bf16 mixed-precision training step of the recipe's draft on random features.

    fp32 master weights and Adam states as DeepSpeed keeps them (12 B per parameter), bf16
    parameters and gradients; the plan is `plan_only`'s at world size 1, less the items this
    step does not hold (the frozen target's weights are not counted, its forward is replaced by
    random features of the right shape).
    """
    from dspine_train.objective import sample_anchors
    from dspine_train.training.draft_step import DraftStep
    from dspine_train.training.memory_plan.for_recipe import memory_plan_for

    recipe = "tiny" if ck.tiny else "qwen3_8b"
    config, target_config, draft_config = recipe_draft(recipe)
    plan = memory_plan_for(config)
    excluded = ("frozen target weights", "target forward working set (no grad)")
    predicted = sum(item.bytes for item in plan.items if item.name not in excluded)
    device, dtype = ck.device, torch.bfloat16
    hidden, vocab = target_config.hidden_size, target_config.vocab_size
    if not ck.tiny:
        real = ck.real()  # the resident 8B-shaped target's embedding and head
        embed, head = real["hf"].model.embed_tokens.weight, real["hf"].lm_head.weight
    else:
        embed = torch.randn(vocab, hidden, device=device, dtype=dtype)
        head = torch.randn(vocab, hidden, device=device, dtype=dtype) * 0.1
    free_device_memory(device)
    baseline = memory_allocated(device)
    from dspine_train.modeling import DSpineDraftModel
    from dspine_train.token_table import build_token_table

    torch.manual_seed(0)
    with torch.device(device):
        draft = DSpineDraftModel(draft_config)
    draft.init_token_table(build_token_table(head.float(), draft_config.transfer_dim))
    draft.to(dtype=dtype).train()
    draft.bind_target(embed, head)
    step = DraftStep(draft, config.logits_chunk_size)
    params = [p for p in step.parameters() if p.requires_grad]
    master = [p.detach().float() for p in params]
    exp_avg = [torch.zeros_like(m) for m in master]
    exp_avg_sq = [torch.zeros_like(m) for m in master]

    d = config.data
    seq, n_ctx = d.max_length, len(draft_config.target_layer_ids)
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab - 1, (d.batch_size, seq), generator=gen).to(device)
    loss_mask = torch.ones(d.batch_size, seq, dtype=torch.long, device=device)
    context = torch.randn(d.batch_size, seq, n_ctx * hidden, device=device, dtype=dtype)
    final = torch.randn(d.batch_size, seq, hidden, device=device, dtype=dtype)
    anchors, anchor_mask = sample_anchors(loss_mask.cpu(), d.num_anchors,
                                          draft_config.block_size, gen)
    anchors, anchor_mask = anchors.to(device), anchor_mask.to(device)
    phases = {}
    sync(device)
    # The window starts at what the step keeps resident (parameters, master weights, Adam
    # states, inputs), not at the transient fp32 copy the draft is built in.
    phases["resident_before_step_gib"] = (memory_allocated(device) - baseline) / GIB
    reset_peak(device)
    start = time.perf_counter()
    loss, _ = step(input_ids, context, final, loss_mask, anchors, anchor_mask, None, step=0,
                   total_steps=1)
    sync(device)
    phases["forward_peak_gib"] = (max_memory(device) - baseline) / GIB
    loss.backward()
    sync(device)
    phases["backward_peak_gib"] = (max_memory(device) - baseline) / GIB
    with torch.no_grad():  # AdamW on the fp32 master, one parameter at a time (no fp32 grad copy)
        for p, m, ea, es in zip(params, master, exp_avg, exp_avg_sq):
            g = p.grad.float()
            p.grad = None
            ea.mul_(0.9).add_(g, alpha=0.1)
            es.mul_(0.95).addcmul_(g, g, value=0.05)
            m.addcdiv_(ea, es.sqrt().add_(1e-8), value=-1e-4)
            p.copy_(m)
    sync(device)
    seconds = time.perf_counter() - start
    measured = (max_memory(device) - baseline) / GIB
    out = dict(
        recipe=recipe, world_size=1, zero_stage=plan.zero_stage, seq_len=seq,
        num_anchors=d.num_anchors, block_size=draft_config.block_size,
        draft_parameters=sum(p.numel() for p in params), loss=float(loss.detach()),
        step_s=round(seconds, 3), plan_total_gib=plan.total_gib,
        excluded_from_prediction=list(excluded), predicted_gib=predicted / GIB,
        headroom=plan.headroom_fraction,
        plan_items={item.name: round(item.gib, 4) for item in plan.items},
    )
    if ck.cuda:
        out.update(measured_gib=measured, measured_over_predicted=measured / (predicted / GIB),
                   **phases)
    else:
        out["measured_gib"] = "not measurable on CPU (no allocator peak counter)"
    return out
