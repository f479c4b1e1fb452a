"""The studies of METHOD 2.5: the ablation (`scripts/ablate.py`: DFlash, DSpine, and DSpine with
one part switched off) and the training study (`scripts/study.py`, docs/STUDY.md), both trained
on the same target, data, budget and seed and measured the same way, through one stack:

    variants.py        `Variant` (overrides; trained, or derived from another's weights), the
                       one registry, and each study's rows (`ABLATION`, `STUDY`)
    runner.py          `StudySettings`; the resumable stages: shared feature cache, one
                       `train.py` run per variant (resume/skip, sessions), derived exports,
                       evaluations cached for the same weights and request
    records.py         the typed records (`Evaluation`, `AblationRow`, `StudyRecord`)
    report.py          the one markdown table formatter and `<stem>.{md,json,png}` writer
    ablation_rows.py   the ablation's rows, read back from each run
    ablation_report.py the ablation's table
    study.py           the study's pieces: variant checks, archive, report rewrites
    study_plan.py      the study's wall-time plan
    study_report.py    the study's report (learning curves, paired differences)
    study_steps.py     `study.py steps`: step times side by side
    study_data.py      the study's data; study_cli.py its command line
    simulated.py       the trainer's simulated acceptance, recomputed for any export
    smoke.py           the tiny target (with a tokenizer) and data of `ablate.py --smoke`
"""
