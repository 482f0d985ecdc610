"""Sharing one pool of spot VMs among several jobs (issue #21, Gavel: Narayanan et al., OSDI'20).

One concept per module, lowest first:

- :mod:`manager.allocation.pool`: the pool's vocabulary (``VMType`` with its spot price and
  memory, ``PoolVM``, ``capacity``).
- :mod:`manager.allocation.throughput`: the job × VM type × VM count throughput matrix, predicted
  by the simulator's auto-config from each job's calibration per type, corrected by measured
  throughput (``ThroughputModel``).
- :mod:`manager.allocation.policies`: allocation policies as linear programs over time fractions
  (max-min fairness of normalised throughput, minimum makespan, maximum throughput per dollar),
  solved with HiGHS through ``scipy.optimize.linprog``.
- :mod:`manager.allocation.rounds`: the round-based mechanism that turns a fractional allocation
  into concrete VMs per round, keeping jobs where they are unless moving pays for its morph.

Pure functions and plain dataclasses: nothing here talks to VMs, the network or the database
(docs/pool.md). The manager daemon does not use it yet.
"""
