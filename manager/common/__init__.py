"""Helpers every side of the manager uses (the daemon, agents, providers): Linux process groups
and identities (:mod:`manager.common.procs`) and the daemon lock on the state file
(:mod:`manager.common.daemon_lock`). Nothing here imports gRPC."""
