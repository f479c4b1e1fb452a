"""Benchmarks and references the product does not run: training-step paths and profiles
(`step_bench`, `step_profile`), the engine's step timings and attention backends
(`engine_profiling`), teacher-forced bf16 agreement (`agreement`), oracle drafts
(`oracle_draft`), the reference clients' block logits and rounds (`reference_parity`), and
`bench_engine.py --compare`: every decoding mode side by side (`side_by_side`) beside
transformers' own plain and prompt-lookup decoding (`hf_reference`).
"""
