"""Benchmarks and references the product does not run: training-step paths and profiles
(`step_bench`, `step_profile`), the engine's step timings and attention backends
(`engine_profiling`), teacher-forced bf16 agreement (`agreement`), oracle drafts
(`oracle_draft`), and the reference clients' block logits and rounds (`reference_parity`).
"""
