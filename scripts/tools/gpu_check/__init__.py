"""GPU check: the CUDA paths of the engine and the trainer, proved in one short run.

Modules: `context` (settings, shared models, device helpers), `models` (local random models),
`environment` (1, 2), `decoding` (3, 4), `timing` (5), `memory` (6), `runner` (report, CLI).

    python scripts/gpu_check.py --out docs/results/gpu_check           # one GPU
    python scripts/gpu_check.py --device cpu --tiny --out /tmp/check   # CI: every step, tiny

Writes OUT/gpu_check.json and OUT/gpu_check.md. Six sections, each a dict with `status`
("ok", "failed" or "skipped"), its `seconds` and its figures; a failing section records its
failed checks or a traceback summary and the others still run. Exit status 1 if any failed.

1. environment: torch / CUDA / cuDNN / transformers versions, the device; the attention op each
   call really runs (profiled: prefill, verify, draft, the draft's training forward), asserted
   on CUDA (no math SDPA fallback; compiled flex attention in training).
2. gpu_tests: `pytest -m gpu` in a subprocess (pass / fail counts); skipped without CUDA.
3. exactness: fp32 tiny target, briefly trained draft: CUDA graphs on / off, speculative vs
   plain vs transformers greedy, batch 1 and a ragged batch of 4, g in {3, 15}.
4. real_shapes: a random target with Qwen3-8B's config (the tiny Qwen3 with --tiny), bf16,
   weights scaled for clear margins; one forward against transformers' Qwen3 with the same
   weights; an oracle draft for lossless checks; bf16 teacher-forced agreement of a multi-row
   verify with row-by-row plain steps.
5. timings: plain step, verify at g + 1 in {4, 8, 16}, draft step, commit (CUDA events,
   median); speed-up tau * t_AR / t_round for tau 3..6; host syncs and kernels per round (CUDA).
6. memory: the engine after set-up and after capture; one training step of the qwen3_8b
   recipe's draft (tiny recipe with --tiny) at its sequence length on random features, peak
   against `plan_only`'s prediction.
"""
