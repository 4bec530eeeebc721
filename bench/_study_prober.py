"""One arm of ``bench/study_latency.py``: a sidecar's search minus the job, every call timed.

Run with the arm's tree first on ``PYTHONPATH``: ``tuner`` comes from there. Writes one JSON
line per step: ``next_move``'s and ``tell``'s milliseconds and the statements each sent.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Engine

from tuner import Knob, KnobSpace, SearchConfig, SearchDriver


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--state-db", required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--knobs", type=int, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    knobs = [Knob(name=f"sim.k{i}", default=1, choices=(1, 2, 4, 8)) for i in range(args.knobs)]
    space = KnobSpace.of(knobs)
    sent = [0]
    event.listen(Engine, "before_cursor_execute", lambda *_: sent.__setitem__(0, sent[0] + 1))
    rng = random.Random(0)
    search: SearchDriver | None = None
    studies = 0
    baseline: dict[str, Any] = {}
    end = time.monotonic() + args.seconds
    with open(args.out, "w", encoding="utf-8") as out:
        while time.monotonic() < end:
            if search is None:
                studies += 1
                search = SearchDriver(space, storage_url=args.state_db,
                                      config=SearchConfig(study_name=f"probe-{studies}"))
                baseline = {k.name: k.default for k in knobs}
            sent[0], t0 = 0, time.perf_counter()
            proposal = search.next_move(baseline, space)
            step: dict[str, Any] = {"next_move_ms": (time.perf_counter() - t0) * 1e3,
                                    "next_move_statements": sent[0]}
            if proposal is None:
                search.close()
                search = None
                continue
            sent[0], t0 = 0, time.perf_counter()
            search.tell(proposal.number, rng.random())
            step.update(tell_ms=(time.perf_counter() - t0) * 1e3, tell_statements=sent[0])
            out.write(json.dumps(step) + "\n")
            if rng.random() < 1 / 3:
                baseline = dict(proposal.values)
            time.sleep(0.1)


if __name__ == "__main__":
    main()
