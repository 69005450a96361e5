"""The demo: a small real training run with an injected fault, guarded or not."""
