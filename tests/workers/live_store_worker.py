"""Worker for tests/test_live_store_auth.py: joins a ``varuna-launch --live-morph`` run's store
(its address and secret from the environment), says it is ready, waits for ``go`` while a
neighbour attacks the store, then checks that both members are still in the group (a barrier)
and writes ``member{m}.json``: whether it was declared dead, whom it saw die, its role."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch.distributed as dist

from varuna.runtime.live_morph import LiveWorld


def main() -> None:
    out = Path(sys.argv[1])
    live = LiveWorld.join(timeout_s=60, freeze_s=5.0)
    (out / f"ready{live.member}").write_text("1")
    deadline = time.monotonic() + 120
    while not (out / "go").exists():  # the test's go, bounded
        if time.monotonic() > deadline:
            sys.exit(3)
        time.sleep(0.05)
    dist.barrier()  # both members are still in the generation's group
    report = {"declared_dead": live.declared_dead(), "known_dead": sorted(live.known_dead()),
              "role": live.role}
    (out / f"member{live.member}.json").write_text(json.dumps(report))
    dist.barrier()
    live.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
