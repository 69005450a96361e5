"""Running a stage on the bus: the worker loop, the stage interface, and per-run state snapshots.

Shared by every component (detectors, fusion, actuator); none of them sees
which bus engine runs it.
"""
