"""A Lightning run guarded by spikeguard: a small MLP learning characters.

    python examples/lightning_trainer.py --fault spike --json

``--fault spike`` scales the inputs of three training batches by 10^4 (a
corrupted batch), ``--fault nan`` makes them NaN. The pipeline runs embedded
(no Kafka), in lockstep (each step waits for its decision, so the
spike is caught at the same step every run; when a follow-up action such as
the learning rate's restore lands can still vary by a step, so the final loss
varies by ~0.05% between runs). The last line printed
with ``--json`` is one JSON object (final_eval_loss, rollbacks, ...). The
integration itself is the ``callbacks=[SpikeguardCallback(...)]`` argument.
"""

from __future__ import annotations

import argparse
import logging
import math
import tempfile
import time
import warnings
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader

from spikeguard.integrations.lightning import SpikeguardCallback
from spikeguard.producers.config import GuardConfig
from spikeguard.runtime import open_runtime
from spikeguard.settings import load_settings

from _shared import CONTEXT, SHORT_RUN, VOCAB, finish, windows


class CharMLP(L.LightningModule):
    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps = steps
        self.net = nn.Sequential(
            nn.Linear(CONTEXT * VOCAB, 96),
            nn.GELU(),
            nn.Linear(96, 96),
            nn.GELU(),
            nn.Linear(96, VOCAB),
        )
        self.corrupt: str | None = None  # set by the Fault callback for the batches it poisons

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.corrupt is not None:
            x = x * 1e4 if self.corrupt == "spike" else x * math.nan
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=8e-3, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=8e-3, total_steps=self.steps + 1, pct_start=0.1
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


class Fault(L.Callback):
    """Corrupts training batches ``first..first+count-1`` of the data stream."""

    def __init__(self, kind: str, first: int = 100, count: int = 3) -> None:
        self.kind, self.first, self.count = kind, first, count
        self.batches = 0  # training batches Lightning has read

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        bad = self.kind != "none" and self.first <= self.batches < self.first + self.count
        pl_module.corrupt = self.kind if bad else None
        self.batches += 1


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fault", choices=("none", "spike", "nan"), default="none")
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object as the last line"
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")
    torch.set_num_threads(1)
    L.seed_everything(args.seed, verbose=False)

    text = Path(argparse.__file__).read_text(encoding="utf-8")
    ids = torch.tensor([min(ord(c), VOCAB - 1) for c in text])
    split = int(len(ids) * 0.9)
    train, held_out = windows(ids[:split]), windows(ids[split:])
    loader = DataLoader(train, batch_size=64, shuffle=True)
    module = CharMLP(args.steps)

    runtime = open_runtime(load_settings(SHORT_RUN))  # the pipeline, embedded, in this process
    work = tempfile.mkdtemp(prefix="spikeguard-lightning-")
    guard = SpikeguardCallback(
        run_id=f"lightning-{args.fault}-{args.seed}-{time.time_ns() % 10**9}",
        config=GuardConfig(
            checkpoint_dir=f"{work}/spikeguard",
            checkpoint_every=20,
            keep_checkpoints=4,
            resume=False,
            lockstep=True,
            healthy_stretch=10,
        ),
        runtime=runtime,
        policy=runtime.settings.policy.model_dump(mode="json", exclude_defaults=True),
    )
    trainer = L.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=work,
        callbacks=[Fault(args.fault), guard],
    )
    started = time.monotonic()
    try:
        trainer.fit(module, loader)
    finally:
        runtime.close()
    module.eval()
    with torch.no_grad():
        x, y = held_out.tensors
        eval_loss = float(nn.functional.cross_entropy(module.net(x[:4096]), y[:4096]))
    g = guard.guard
    result = {
        "example": "lightning_trainer",
        "fault": args.fault,
        "final_eval_loss": eval_loss,
        "rollbacks": g.counters["rollbacks"],
        "global_step": trainer.global_step,
        "skipped_updates": g.counters["skipped_updates"],
        "updates": g.counters["updates"],
        "actions": sorted({a["kind"] for a in g.applied if a["status"] == "applied"}),
        "seconds": round(time.monotonic() - started, 1),
    }
    return finish(result, args.json)


if __name__ == "__main__":
    main()
