"""What the three examples share: the short-run policy, the character windows, the result line.

Run the examples as scripts (``python examples/plain_loop.py``): Python puts
this directory on the path, so ``from _shared import ...`` finds this file.
"""

from __future__ import annotations

import json

import torch
from torch import nn
from torch.utils.data import TensorDataset

# The policy's defaults are sized for runs of many thousand steps; these have 300.
SHORT_RUN = {
    "policy.rollback_min_steps_before_onset": 20,
    "policy.skip_extra_batches": 4,
    "policy.lr_restore_healthy_steps": 10,
    "policy.lr_restore_factor": 1.5,
    "policy.clip_mode": "adaptive",
    "policy.divergence_step_interval_steps": 10,
    "policy.preventive_min_interval_steps": 50,
}
CONTEXT, VOCAB = 8, 128


def windows(ids: torch.Tensor) -> TensorDataset:
    """(one-hot window of CONTEXT characters, next character) at every position."""
    starts = torch.arange(len(ids) - CONTEXT)
    x = ids[starts[:, None] + torch.arange(CONTEXT)]
    return TensorDataset(
        nn.functional.one_hot(x, VOCAB).float().reshape(len(x), -1), ids[starts + CONTEXT]
    )


def finish(result: dict, as_json: bool) -> dict:
    """Print the outcome: one JSON object as the last line with ``--json``, else one sentence."""
    if as_json:
        print(json.dumps(result))
    else:
        print(
            f"final eval loss {result['final_eval_loss']:.4f}, {result['rollbacks']} rollback(s), "
            f"{result['skipped_updates']} skipped update(s), {result['seconds']} s"
        )
    return result
