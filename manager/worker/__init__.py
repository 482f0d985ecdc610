"""What runs in a training worker: the shim the agents start scripts through
(:mod:`manager.worker.shim`). Never imports the domain."""
