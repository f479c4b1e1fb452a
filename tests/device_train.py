"""Run the real trainer with its tensors on an accelerator: `fakegpu` (the device-faithful
harness, any machine) or `cuda`; report the host syncs of every training micro-batch.

    python tests/device_train.py --device fakegpu --report R.json -- recipe=tiny output_dir=...

It composes the recipe as `train.py` does, puts accelerate's and DeepSpeed's device on the
harness (on `cuda` nothing is changed), counts the syncs of each `Trainer._micro_batch`, trains
(evaluations, checkpoints, resume and export as configured) and writes the report JSON:
`micro_batch_syncs` (one count per micro-batch) and the sites of the first micro-batch's syncs.
A separate process: the harness, accelerate's state and the process group stay out of pytest.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from device_harness import DEVICE_TYPE, accelerator  # noqa: E402

from dspine_train.training import trainer as trainer_module  # noqa: E402
from scripts.tools.ablation.study import compose_train_config  # noqa: E402


def _put_accelerate_on(device: torch.device) -> None:
    """accelerate's `Accelerator.device` and DeepSpeed's accelerator name `device`."""
    from deepspeed.accelerator import get_accelerator

    build = trainer_module.build_accelerator

    def build_on_device(config):  # noqa: ANN001, ANN202 - same signature as the original
        acc = build(config)
        acc.__class__ = type("DeviceAccelerator", (type(acc),),
                             {"device": property(lambda self: device)})
        return acc

    trainer_module.build_accelerator = build_on_device
    ds = get_accelerator()
    ds.current_device_name = lambda: str(device)
    ds.device_name = lambda index=None: device.type if index is None else f"{device.type}:{index}"


def _count_target_projections() -> list[int]:
    """Rows projected through the target's head (its distribution for distillation): by the
    objective per block slot (`target_logits`) or per position (`target_topk`)."""
    from dspine_train.modeling import DSpineDraftModel
    from dspine_train.training import target as target_module

    rows: list[int] = []
    per_slot, per_position = DSpineDraftModel.target_logits, target_module.target_topk

    def target_logits(self, hidden, *args, **kwargs):  # noqa: ANN001, ANN202
        rows.append(hidden.reshape(-1, hidden.shape[-1]).shape[0])
        return per_slot(self, hidden, *args, **kwargs)

    def target_topk(states, *args, **kwargs):  # noqa: ANN001, ANN202
        rows.append(states.shape[0])
        return per_position(states, *args, **kwargs)

    DSpineDraftModel.target_logits = target_logits
    target_module.target_topk = target_topk
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=[DEVICE_TYPE, "cuda"], default=DEVICE_TYPE)
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    config = compose_train_config(args.overrides)
    per_batch: list[int] = []
    sites: list[list[str]] = []
    positions: list[int] = []  # token positions of each micro-batch (B x S)
    target_rows: list[int] = []  # rows projected through the target's head in each
    with accelerator(args.device) as dev:
        if args.device == DEVICE_TYPE:
            _put_accelerate_on(dev.device)
        micro_batch = trainer_module.Trainer._micro_batch
        projected = _count_target_projections()

        def counted(self, index, rows):  # noqa: ANN001, ANN202
            projected.clear()
            with dev.counting() as syncs:
                out = micro_batch(self, index, rows)
            per_batch.append(sum(syncs.values()))
            positions.append(int(self.train_batches.collate(rows).input_ids.numel()))
            target_rows.append(sum(projected))
            if not sites:
                sites.extend([list(site) for site in syncs.sites])
            return out

        trainer_module.Trainer._micro_batch = counted
        result = trainer_module.run_training(config)
    args.report.write_text(json.dumps({
        "device": str(dev.device), "steps": result.steps, "micro_batch_syncs": per_batch,
        "first_micro_batch_sites": sites, "syncs_by_kind": dict(dev.syncs),
        "micro_batch_positions": positions, "target_head_rows": target_rows,
    }, indent=1))
    print(f"done: {result.steps} steps on {dev.device}; syncs per micro-batch {per_batch}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
