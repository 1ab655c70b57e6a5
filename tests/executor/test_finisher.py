"""The worker's finisher (executor/finisher.py): jobs finish in order on their own thread; the
main thread hands over up to `depth` pending jobs without waiting, then waits for the oldest;
`wait_idle` waits for every pending one (what an out-of-memory retry needs)."""

from __future__ import annotations

import threading

from tests.conftest import wait_for
from vllm_omni_like.executor.finisher import Finisher


def test_two_jobs_are_handed_over_at_once_and_a_third_waits_for_the_oldest():
    release = {i: threading.Event() for i in range(3)}
    done: list[int] = []

    def finish(job: int) -> None:
        release[job].wait(10)
        done.append(job)

    finisher: Finisher[int] = Finisher(finish, depth=2)
    threading.Thread(target=finisher.run_forever, daemon=True).start()
    finisher.put(0)
    finisher.put(1)  # two pending (0 finishing, 1 waiting): no wait
    assert finisher.busy
    third = threading.Thread(target=finisher.put, args=(2,))
    third.start()
    third.join(0.3)
    assert third.is_alive()  # a third waits while two are pending
    release[0].set()
    third.join(10)
    assert not third.is_alive() and done == [0]  # job 0 done: room for job 2
    idle = threading.Thread(target=finisher.wait_idle)
    idle.start()
    idle.join(0.2)
    assert idle.is_alive()  # jobs 1 and 2 still pending
    release[1].set()
    release[2].set()
    idle.join(10)
    assert not idle.is_alive() and done == [0, 1, 2]  # in order
    wait_for(lambda: not finisher.busy, 5, "the finisher idle")
    assert finisher.wait_idle() is False  # nothing pending: returns at once
