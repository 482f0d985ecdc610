"""The manager daemon's domain: jobs, the VM book, morph planning, live runs, the pool and the
store, in plain dataclasses. Nothing here imports gRPC or the generated modules (an import
contract in pyproject.toml says so); :mod:`manager.transport` converts at the edge."""
