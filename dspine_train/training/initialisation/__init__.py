"""Where a run's draft starts from, other than a fresh seeded init: one module per source.

    from_dflash.py          `model.init_from` = a DFlash checkpoint: its backbone, DSpine's own
                            parts fresh (and the structure checks the other sources share)
    from_export.py          `model.init_from` = a DSpine export (or SpecForge's): training
                            continues from it
    from_target_layers.py   `model.warm_start_layers`: draft layers copied from target layers

`training.draft_builder` picks the source from the config and builds the draft.
"""
