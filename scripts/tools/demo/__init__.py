"""The demo's pieces (`scripts/demo.py`, `make demo`); the script keeps the command line.

    records.py    `DemoError`, a finished stage's record (`StageRecord`), the shared paths and
                  settings (`Demo`), the settings fingerprint, atomic JSON writes
    settings.py   the resolved dtypes and draft shape, the `train.py` overrides and config
    stages.py     one function per stage: what it runs and the figures it records
    runner.py     the stage order and cache keys (`SPECS`), running or skipping a stage, the
                  final report
"""
