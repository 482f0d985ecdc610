"""Rigs for developing on a small machine: network emulation at the torch.distributed P2P layer
(``netem``), emulated accelerator blocks and a local-world spawner (``emulated``)."""
