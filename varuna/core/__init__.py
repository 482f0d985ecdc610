"""The pure core: schedules, partitioning, micro-batch plans, the calibration schema, timelines and
the worker environment contract. Nothing here imports torch (an import-linter contract holds it),
so the simulator and auto-config can use it on a machine without torch."""
