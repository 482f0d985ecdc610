"""What runs on a VM: the agent (:mod:`manager.agent.vm_agent`), its workers
(:mod:`manager.agent.workers`), calibration runs (:mod:`manager.agent.calibrate`) and eviction
notice sources (:mod:`manager.agent.scheduled_events`). Never imports the domain."""
