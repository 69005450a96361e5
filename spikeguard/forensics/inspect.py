"""``inspect``: an incident's samples, ranked, written to JSON and HTML.

spikeguard cannot build the user's model or dataset, so the user names a
function that does (``module:function``, returning an :class:`InspectSetup`);
the weights come from the checkpoint the Guard took before the onset.
"""

from __future__ import annotations

import html
import importlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from spikeguard.errors import SpikeguardError
from spikeguard.forensics.record import IncidentBatches
from spikeguard.forensics.samples import LossFn, rank_samples

TOP = 20


class InspectSetupError(SpikeguardError):
    """The ``--setup`` function could not be found or returned something else."""


@dataclass
class InspectSetup:
    """What ``inspect`` needs from the user's code (the weights come from the checkpoint)."""

    model: torch.nn.Module
    dataset: Any  # dataset[sample_id] -> one item
    collate: Callable[[list[Any]], Any]  # a batch from a list of items
    loss_fn: LossFn  # (model, batch) -> per-sample losses


def _import_from_here(module_name: str) -> Any:
    """Import ``module_name`` as ``python -m`` would: the current directory first.

    The ``spikeguard`` console script's path starts at its own bin directory, so
    a user's ``mymod.py`` beside them would need ``PYTHONPATH=.`` otherwise.
    """
    here = os.getcwd()
    if here in sys.path or "" in sys.path:
        return importlib.import_module(module_name)
    sys.path.insert(0, here)
    try:
        return importlib.import_module(module_name)
    finally:
        sys.path.remove(here)


def load_setup(spec: str) -> InspectSetup:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise InspectSetupError(f"--setup {spec!r}: expected MODULE:FUNCTION")
    try:
        factory = getattr(_import_from_here(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise InspectSetupError(f"--setup {spec!r}: {exc}") from None
    setup = factory()
    if not isinstance(setup, InspectSetup):
        raise InspectSetupError(
            f"--setup {spec!r} returned {type(setup).__name__}, not an InspectSetup"
        )
    return setup


def inspect_incident(
    incident: IncidentBatches, setup: InspectSetup, out_dir: str | Path, top: int = TOP
) -> dict:
    """Rank the incident's samples through its pre-onset checkpoint; write JSON and HTML."""
    if incident.checkpoint is None:
        raise SpikeguardError(
            f"incident {incident.incident_id}: no checkpoint before its onset was kept"
        )
    if not Path(incident.checkpoint).is_file():
        raise SpikeguardError(
            f"incident {incident.incident_id}: its checkpoint {incident.checkpoint} is "
            f"missing (keep the .pt file next to the incident's .json)"
        )
    body = torch.load(incident.checkpoint, map_location="cpu", weights_only=True)
    setup.model.load_state_dict(body["model"])
    items = [
        (sid, batch["step"], setup.dataset[sid])
        for batch in incident.batches
        for sid in batch["ids"]
    ]
    if not items:
        raise SpikeguardError(
            f"incident {incident.incident_id}: no sample ids were recorded for its window"
        )
    ranked = rank_samples(setup.model, items, setup.collate, setup.loss_fn)
    top_rows = [
        {
            "sample_id": s.sample_id,
            "step": s.step,
            "loss": s.loss,
            "grad_norm": s.grad_norm,
            "loss_z": round(s.loss_z, 2),
            "grad_z": round(s.grad_z, 2),
            "score": round(s.score, 2),
        }
        for s in ranked[:top]
    ]
    report: dict[str, object] = {
        "run_id": incident.run_id,
        "incident_id": incident.incident_id,
        "onset_step": incident.onset_step,
        "epoch": incident.epoch,
        "checkpoint_step": incident.checkpoint_step,
        "samples": len(items),
        "steps": [b["step"] for b in incident.batches],
        "top": top_rows,
        "skip_ids": [s.sample_id for s in ranked[:top] if round(s.score, 2) >= 6],
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"inspect-{incident.run_id}-{incident.incident_id}"
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1, default=str), encoding="utf-8")
    (out / f"{stem}.html").write_text(_html(report), encoding="utf-8")
    return report


def _html(report: dict) -> str:
    e = html.escape
    rows = "".join(
        f"<tr><td>{i}</td><td>{e(str(r['sample_id']))}</td><td>{r['step']}</td><td>{r['loss']:.4g}</td>"
        f"<td>{r['grad_norm']:.4g}</td><td>{r['loss_z']}</td><td>{r['grad_z']}</td><td><b>{r['score']}</b></td></tr>"
        for i, r in enumerate(report["top"], 1)
    )
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>spikeguard inspect</title></head><body>"
        f"<h1>Incident {e(report['incident_id'])} of run {e(report['run_id'])}</h1>"
        f"<p>Onset at step {report['onset_step']} (epoch {report['epoch']}); {report['samples']} samples "
        f"of steps {e(', '.join(map(str, report['steps'])))} replayed one by one through the checkpoint "
        f"of step {report['checkpoint_step']}. Score: the larger robust z (log scale, median/MAD of the "
        f"window) of the sample's own loss and gradient norm.</p>"
        "<table border=1><tr><th>#</th><th>sample id</th><th>step</th><th>loss</th><th>grad norm</th>"
        f"<th>loss z</th><th>grad z</th><th>score</th></tr>{rows}</table>"
        f"<p>Skip list (score &ge; 6): {e(json.dumps(report['skip_ids'], default=str))}</p></body></html>"
    )
