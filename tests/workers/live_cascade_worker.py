"""Worker: the failure cascade of a live tear-down (Note [Live watch] in varuna/runtime/live_watch.py).

Two members at 1×2 (stage 0, stage 1) post the receives of a step without running it: member
0's gradient receiver waits on member 1 and member 1's activation receiver waits on member 0 --
each survivor blocked on the other, the cycle that kept old groups alive until a 10 s thread
join timed out, per blocked receiver and per hop of a chain. Member 1 then tears its engine down
as after a failed step (``live_morph._tear_down``), its ``Engine.close`` held back until member 0
says its receiver failed (bounded by ``--within``): the sever alone, before any thread join or
group destruction, must free member 0. Each writes what it saw to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
from datetime import timedelta
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from models import build_model  # noqa: E402

import varuna  # noqa: E402
from varuna.runtime.live_morph import LiveWorld, _tear_down  # noqa: E402

RELEASED = "test/released/0"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--within", type=float, required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    member = int(os.environ["RANK"])
    live = LiveWorld.join(timeout_s=120.0, freeze_s=0)
    batch = torch.zeros(4, 16, dtype=torch.long), torch.zeros(4, 16, dtype=torch.long)
    config = varuna.VarunaConfig(global_batch_size=4, micro_batch_size=2, pipeline_depth=2, data_parallel=1,
                                 timeouts=varuna.TimeoutConfig(comm_s=120.0, peer_s=0))
    engine = varuna.Engine(build_model("gpt"), config, example_batch=batch,
                           optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    live.guard("engine", live.members, list(engine._groups.created))
    engine._links.begin_step(2, train=True)  # both receivers now wait on the other member
    live.store.set(f"test/posted/{member}", "1")
    live.store.wait([f"test/posted/{1 - member}"])
    result: dict = {}
    if member == 1:
        close = engine.close

        def close_once_member_0_is_free(**kw) -> None:
            try:
                live.store.wait([RELEASED], timedelta(seconds=a.within))
                result["released_before_close"] = True
            except RuntimeError:  # the store's wait timed out: nothing but close() could free it
                result["released_before_close"] = False
            close(**kw)

        engine.close = close_once_member_0_is_free
        _tear_down(live, engine, failed=True)
    else:
        try:
            item = engine._executor.inbox.get(timeout=a.within)
            result = {"released": isinstance(item, Exception), "error": str(item)[-200:]}
            live.store.set(RELEASED, "1")
        except queue.Empty:
            result = {"released": False, "error": f"still blocked after {a.within}s"}
        _tear_down(live, engine, failed=True)
    live.close()
    (a.out / f"member{member}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
