"""Launching workers: the single-machine launcher and its supervisor, host lists and OpenSSH, the
per-host agent and its line protocol. Sits above the simulator (auto-config picks P×D)."""
