"""The ablation study of METHOD 2.5 (`scripts/ablate.py`): DFlash, DSpine, and DSpine with one
part switched off, trained on the same target, data, budget and seed, measured the same way.

    variants.py   the rows: `Variant` (config switches; trained, or derived from another's weights)
    runner.py     shared feature cache, one `train.py` run per variant, resume/skip, evaluation
    simulated.py  the trainer's simulated acceptance, recomputed for any export
    report.py     the table as markdown, JSON and PNG
    smoke.py      the tiny target (with a tokenizer) and data of `--smoke`
"""
