"""The training runtime: ``Engine`` (schedule execution, gradient sync, optimizer step), point-to-point
communication, deterministic reduction, loss scaling and checkpoints."""
