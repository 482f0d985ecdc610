"""The varuna job manager: keeps a pipeline + data-parallel job training on spot VMs.

``varuna-manager serve`` (:mod:`manager.transport.server`, :mod:`manager.domain.controller`) supervises jobs
submitted with ``varuna-manager submit`` (:mod:`manager.cli`); per-VM agents
(:mod:`manager.agent.vm_agent`) run the workers through :mod:`manager.worker.shim`; VMs come from a
provider (:mod:`manager.providers`). See docs/manager.md.
"""
