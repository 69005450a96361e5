"""A HuggingFace Trainer run guarded by spikeguard: a tiny GPT-2 learning characters.

    python examples/hf_trainer.py --fault spike --json

The model is built from ``GPT2Config`` with random weights (nothing is
downloaded) and learns the next character of a standard-library module's
source. ``--fault spike`` multiplies the logits of three training batches by
10^4 (a corrupted batch), ``--fault nan`` makes them NaN; the pipeline runs
embedded (no Kafka), in lockstep (each step waits for its decision, so the
spike is caught at the same step every run; when a follow-up action such as
the learning rate's restore lands can still vary by a step, so the final loss
varies by ~0.05% between runs). The last line
printed with ``--json`` is one JSON object (final_eval_loss, rollbacks, ...).
The integration itself is the ``callbacks=[SpikeguardCallback(...)]`` line.
"""

from __future__ import annotations

import argparse
import logging
import math
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from spikeguard.integrations.hf import SpikeguardCallback
from spikeguard.producers.config import GuardConfig
from spikeguard.runtime import open_runtime
from spikeguard.settings import load_settings

from _shared import SHORT_RUN, finish


class Chars(Dataset):
    """Windows of ``length`` characters of ``text``; the model predicts each next one."""

    def __init__(self, ids: torch.Tensor, length: int, stride: int) -> None:
        self.ids, self.length = ids, length
        self.starts = list(range(0, len(ids) - length - 1, stride))

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        window = self.ids[self.starts[i] : self.starts[i] + self.length]
        return {"input_ids": window, "labels": window}


class Fault(TrainerCallback):
    """Corrupts the logits of training batches ``first..first+count-1`` of the data stream."""

    def __init__(self, kind: str, first: int = 100, count: int = 3, scale: float = 1e4) -> None:
        self.kind, self.first, self.count, self.scale = kind, first, count, scale
        self.batches = 0  # training batches the Trainer has read (one per step here)
        self.active = False

    def attach(self, model: GPT2LMHeadModel) -> None:
        model.lm_head.register_forward_hook(self._corrupt)

    def on_step_begin(self, args, state, control, **kwargs):
        self.active = self.kind != "none" and self.first <= self.batches < self.first + self.count
        self.batches += 1

    def _corrupt(self, module, args, output):
        if not (module.training and self.active):
            return None
        return output * self.scale if self.kind == "spike" else output * math.nan


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fault", choices=("none", "spike", "nan"), default="none")
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object as the last line"
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)

    text = Path(argparse.__file__).read_text(encoding="utf-8")
    ids = torch.tensor([min(ord(c), 127) for c in text])
    split = int(len(ids) * 0.9)
    train, held_out = Chars(ids[:split], 32, 7), Chars(ids[split:], 32, 32)
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4)
    )
    fault = Fault(args.fault)
    fault.attach(model)

    runtime = open_runtime(load_settings(SHORT_RUN))  # the pipeline, embedded, in this process
    work = tempfile.mkdtemp(prefix="spikeguard-hf-")
    guard = SpikeguardCallback(
        run_id=f"hf-{args.fault}-{args.seed}-{time.time_ns() % 10**9}",
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
    training = TrainingArguments(
        output_dir=work,
        max_steps=args.steps,
        per_device_train_batch_size=16,
        learning_rate=3e-3,
        lr_scheduler_type="cosine",
        warmup_steps=20,
        weight_decay=0.01,
        max_grad_norm=0.0,
        seed=args.seed,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=10_000,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=train,
        eval_dataset=held_out,
        callbacks=[fault, guard],
    )
    started = time.monotonic()
    try:
        trainer.train()
        eval_loss = trainer.evaluate()["eval_loss"]
    finally:
        runtime.close()
    g = guard.guard
    result = {
        "example": "hf_trainer",
        "fault": args.fault,
        "final_eval_loss": eval_loss,
        "rollbacks": g.counters["rollbacks"],
        "global_step": trainer.state.global_step,
        "skipped_updates": g.counters["skipped_updates"],
        "updates": g.counters["updates"],
        "actions": sorted({a["kind"] for a in g.applied if a["status"] == "applied"}),
        "seconds": round(time.monotonic() - started, 1),
    }
    return finish(result, args.json)


if __name__ == "__main__":
    main()
