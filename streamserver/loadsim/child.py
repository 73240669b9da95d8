"""A child process of a large load-simulation run: some of the students, on their own CPU core.

One Python process sends about 1,500 real-time 20 ms streams at most (a socket write per frame);
`loadsim --processes P` spreads the students over P of these. Input on stdin, one JSON object:
{"plan": StudentPlan fields, "indices": [student indices]}. Output on stdout: a Tally snapshot
(JSON, one line) every half second and a last one when its students are done.
"""

from __future__ import annotations

import asyncio
import json
import sys

from streamserver.heap import freeze_startup_heap
from streamserver.loadsim.measure import Tally
from streamserver.loadsim.students import StudentPlan, StudentPool
from streamserver.transport.udp import DrainingEventLoop

REPORT_EVERY_S = 0.5


async def main() -> None:
    spec = json.loads(sys.stdin.read())
    tally = Tally()
    freeze_startup_heap()  # a full collection would stall every student's frames (streamserver/heap.py)
    students = asyncio.create_task(StudentPool(StudentPlan(**spec["plan"]), tally).run(spec["indices"]))
    while not students.done():
        print(json.dumps(tally.snapshot()), flush=True)  # tens of KB at most: the parent reads it at once
        await asyncio.wait([students], timeout=REPORT_EVERY_S)
    print(json.dumps(tally.snapshot()), flush=True)
    students.result()


if __name__ == "__main__":
    with asyncio.Runner(loop_factory=DrainingEventLoop) as runner:  # its students' sockets read like the server's
        runner.run(main())
