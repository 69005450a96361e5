"""spikeguard inside the trainers people use: one callback per framework.

- ``spikeguard.integrations.hf``: a ``transformers.TrainerCallback`` (extra ``[hf]``);
- ``spikeguard.integrations.lightning``: a Lightning ``Callback`` (extra ``[lightning]``);
- ``spikeguard.integrations.loggers``: actions to TensorBoard and W&B when installed
  (``GuardConfig(loggers=[...])``).

Both drive the Guard's two-halves step (producers/external_loop.py) from the
framework's public hooks; each module imports its framework, this one nothing.
"""
