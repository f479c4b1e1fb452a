"""Per-GPU memory plan of a DSpine training run, computed from configs alone (no weights loaded).

`python train.py recipe=qwen3_8b plan_only=true` calls `for_recipe.memory_plan_for` (which
calls `estimate.estimate_memory`) and prints `MemoryPlan.table()`: one row per resident item at
the recipe's ZeRO stage and world size, the total, and whether it fits a given GPU.

    plan.py          MemoryItem, MemoryPlan: the items, their total, the verdict and the table
    parameters.py    parameter counts: draft and target built on the `meta` device
    activations.py   what autograd keeps in the draft's forward; the attention kernels' items
    estimate.py      estimate_memory: every item of one training setup
    for_recipe.py    the plan of a `TrainConfig` (`plan_only=true`): its target and draft configs

Notation used in every formula below (all sizes are element counts unless said otherwise):

    H  target hidden size        V  vocabulary size           L  target depth
    q  heads * head_dim          kv key/value heads * head_dim
    I  MLP intermediate size     N  draft layers              n  context layers (default N)
    r  transfer_dim              m  message_size              K  candidate_k
    b  micro-batch size          S  max_length                A  anchors per sequence
    B  block size                W  world size (GPUs)         c  logits chunk (slots)
    h  attention heads           Q  queries A*B               KV keys S + A*B
    nq ceil(Q/128)               nk ceil(KV/128)  (flex attention's 128 x 128 mask tiles)
    P  trainable draft parameters
    p  bytes per element of `param_dtype` (2 for bf16/fp16, 4 for fp32)
    f  4 / p, an fp32 copy's size in p-byte elements (the norms compute in fp32)

Assumptions (each one is a choice a real run can break; the headroom covers small ones):
    * The frozen target is not wrapped by DeepSpeed: its weights are replicated on every GPU in
      `param_dtype`, at every ZeRO stage. With offline features only its embedding and lm_head
      stay on the GPU (the draft's frozen input embedding and output head).
    * Mixed precision (bf16/fp16): p-byte parameters, p-byte gradients, fp32 master weights and
      fp32 Adam m and v (4 + 4 + 4 = 12 bytes per parameter). Pure fp32: 4-byte parameters and
      gradients and 8 bytes of Adam state, no master copy.
    * ZeRO-2 partitions gradients and optimizer states over W; parameters stay replicated.
      ZeRO-3 partitions parameters too and gathers them module by module; we count two gathered
      modules (the one running and the one prefetched). DeepSpeed may keep more parameters live
      (up to `stage3_max_live_parameters`); lower that setting if the plan is tight.
    * Gradient accumulation adds no memory: micro-batches accumulate into the same gradient
      partition. It only changes the tokens per optimizer step.
    * The draft's attention is planned for the path the run takes (`attention_path`), counted
      from what each kernel keeps (see `attention_items`). "flex" (CUDA): compiled flex
      attention, which materialises no score matrix; it keeps per layer an fp32 logsumexp and
      shares one block-sparse mask (index tensors of full and partial 128 x 128 tiles, and their
      transposes for backward). "dense" (CPU): SDPA's flash kernel with the boolean
      (b, 1, Q, KV) mask, which it turns into an additive p-byte mask of the same shape in
      every layer and keeps for backward, plus the logsumexp. Neither keeps scores; the
      attention output and its q/k/v are in the block and context items.
    * The target runs without its lm_head (the objective applies the head per chunk) and
      without a KV cache, under `no_grad`.
    * The loss is computed in chunks of c block slots; only one chunk of full-vocabulary fp32
      tensors exists at a time (METHOD 4).
    * Activations are what autograd keeps for backward in the real `DraftStep` forward and
      objective (`draft_activation_elements`); `tests/test_memory_plan.py` measures them.
    * Not counted, left to the headroom: CUDA context and NCCL buffers, DeepSpeed communication
      buckets, allocator fragmentation, gradients of activations during backward (at most about
      one layer's activations at a time).
"""
