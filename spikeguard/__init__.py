"""spikeguard keeps PyTorch training runs alive through loss spikes.

    from spikeguard import Guard
    guard = Guard(model, optimizer, scheduler, run_id="my-run")
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy: the CLI and the workers import spikeguard without needing torch.
    if name == "Guard":
        from spikeguard.producers.guard import Guard

        return Guard
    raise AttributeError(f"module 'spikeguard' has no attribute {name!r}")
