"""The fp16 GradScaler as the Guard drives it, through its public API only.

- The gradients are unscaled once, at the start of ``guard.step``: the
  statistics the pipeline judges and the clipping threshold are about the true
  gradients, not gradients 65,536 times larger.
- A step whose unscaled gradients hold an inf/NaN (with a finite loss) is the
  scaler's normal overflow: ``scaler.step`` skips the update and ``update()``
  lowers the scale. Not an anomaly. What *is* one is a run of such skips,
  each lowering the scale further: the Guard reports its length per step
  (``StepEvent.overflow_streak``) beside the scale itself.
- When the Guard itself voids a step (a non-finite loss, its local outlier
  rule, a rollback), the scaler is put back as it was before the step: the
  step did not happen, so it neither grows nor lowers the scale. This also
  ends the "unscaled" stage, which ``update()`` alone cannot do without
  ``step()`` (it asserts "No inf checks were recorded").
"""

from __future__ import annotations

from typing import Any, Callable


class ScalerControl:
    def __init__(self, scaler: Any = None) -> None:
        self.scaler = scaler
        self.streak = 0  # consecutive overflow skips, the current one included

    @property
    def enabled(self) -> bool:
        return self.scaler is not None and self.scaler.is_enabled()

    def begin(self, optimizer: Any) -> None:
        """Unscale the gradients, once, before the statistics are taken."""
        if not self.enabled:
            return
        try:
            self.scaler.unscale_(optimizer)
        except RuntimeError as exc:  # the user unscaled already (to clip on their own): fine
            if "already been called" not in str(exc):
                raise

    def scale(self) -> float | None:
        """The scale this step's gradients were computed with.

        Read after the statistics' transfer has synchronised the device, so the
        copy waits for nothing but the tiny unscale kernels.
        """
        return float(self.scaler.get_scale()) if self.enabled else None

    def step(self, run: Callable[[Callable[[], Any]], Any], optimizer: Any) -> None:
        """``scaler.step`` (through ``run``, e.g. the LR wrapper), then ``update``."""
        if not self.enabled:
            run(optimizer.step)
            return
        run(lambda: self.scaler.step(optimizer))
        self.scaler.update()

    def count(self, overflow: bool) -> None:
        """The scaler stepped this update: its overflow streak goes on or ends.

        ``overflow``: the unscaled gradients hold an inf/NaN, which is exactly what
        the scaler's own check finds in the same gradients, so the Guard knows it
        from its statistics without another device-to-host copy.
        """
        if self.enabled:
            self.streak = self.streak + 1 if overflow else 0

    def keep(self) -> dict[str, Any] | None:
        """The scaler's state now, for ``put_back`` once a step that did not happen is over."""
        return self.scaler.state_dict() if self.enabled else None

    def put_back(self, kept: dict[str, Any] | None) -> None:
        if kept is not None:
            self.scaler.load_state_dict(kept)

    def void(self) -> None:
        """This step's update will not happen: keep the scale as it is now (after a rollback,
        the checkpoint's), and end the step's unscaled stage so the next step can unscale."""
        if not self.enabled:
            return
        now = self.keep()
        self.scaler.update()  # resets the per-step stage; the inf checks were recorded by unscale_
        self.put_back(now)
