"""The repository's entry-point scripts and, under `tools/`, the modules they import.

Nothing in the product (`dspine_train`, `data_prep`) imports from here (`tests/test_layering.py`).
"""
