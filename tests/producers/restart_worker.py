"""A training process for the kill-and-restart test (run as a script)."""

from __future__ import annotations

import json
import sys
import time

import torch

from spikeguard.bus import EmbeddedBus
from spikeguard.producers import Guard, GuardConfig
from spikeguard.schemas import Action, ActionKind, Topics, encode

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from producers_helpers import Tiny


def main(ckpt_dir: str, bus_dir: str, steps: int) -> None:
    torch.set_num_threads(1)
    bus = EmbeddedBus(data_dir=bus_dir)
    tiny = Tiny(seed=3)
    guard = Guard(
        tiny.model,
        tiny.optimizer,
        run_id="k",
        bus=bus,
        config=GuardConfig(checkpoint_dir=ckpt_dir, checkpoint_every=10, resume=True),
    )
    print(
        json.dumps(
            {
                "resumed_from": guard.resumed_from.step if guard.resumed_from else None,
                "scale": guard.lr.scale,
            }
        ),
        flush=True,
    )
    # Published on every start: a re-delivery, as an actuator restarted after a crash would do.
    action = Action(
        action_id="a-kill-1",
        run_id="k",
        kind=ActionKind.SCALE_LR,
        apply_at_step=14,
        params={"factor": 0.5},
    )
    bus.producer().publish(Topics().actions, encode(action), key="k")
    deadline = time.monotonic() + 10
    while guard.inbox._handed < 1 and time.monotonic() < deadline:
        time.sleep(0.002)
    data = guard.data(tiny.loader, max_steps=steps)
    while guard.step_count < steps:
        for batch in data:
            guard.step(tiny.loss(batch))
            print(json.dumps({"step": guard.step_count, "scale": guard.lr.scale}), flush=True)
            if guard.step_count > 15:
                time.sleep(0.05)  # give the test time to kill us between checkpoints
    guard.close()
    bus.close()
    print(
        json.dumps({"done": True, "applied": list(guard.applied), "scale": guard.lr.scale}),
        flush=True,
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
