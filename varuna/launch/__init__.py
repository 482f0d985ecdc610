"""Launching workers (``varuna-launch``). Modules, lowest first: ``procs`` (parent-death signal,
free ports), ``protocol`` (the agent line protocol), ``spec`` (job config, per-rank specs, the
Host/WorkerHandle interfaces), ``hosts`` (host lists), ``ssh`` (OpenSSH), ``layout`` (P×D and
the run plan, auto-config through the simulator), ``local`` (workers on this machine),
``supervisor``, ``agent_host`` (the launcher's side of a per-host agent), ``agent`` (the agent
itself, ``python -m varuna.launch.agent``), ``job`` (``launch``/``launch_on_hosts``) and
``launcher`` (the command line). Sits above the simulator (auto-config picks P×D)."""
