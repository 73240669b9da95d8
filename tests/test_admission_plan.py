"""Admission plans a class on the workers' lowest recent capacity (capacity.py): a worker's own
measure moves with the batches it happens to run, and students told busy who try again must
not be seated on its highs."""

from streamserver.capacity import CAPACITY_WINDOW_S, PLANNED_LOAD, Capacity, Load


def _capacity(students: int) -> Capacity:
    return Capacity(sink=None, loop_lag=None, students=lambda: students, expected_speaking=0.1, name="g")  # type: ignore[arg-type]


def test_a_high_reading_seats_no_one_the_low_ones_turned_away():
    cap = _capacity(students=100)  # 100 (+1) students at 0.1 / 5 s: about 2.0 utterances/s planned
    cap._remember_capacity(Load(100, 2.0, 5.0, 1), now=0.0)  # 0.4 x 5.0 = 2.0: full
    cap.fleet, cap._told = Load(100, 2.0, 5.0, 1), 100
    assert cap.recognition_full() is not None
    cap.fleet = Load(100, 2.0, 9.0, 1)  # a run of short batches: the worker reads 9 utterances/s
    cap._remember_capacity(cap.fleet, now=10.0)
    reason = cap.recognition_full()
    assert reason is not None and "take 5.0" in reason
    # Once the low reading is older than the window, the higher capacity counts.
    cap._remember_capacity(cap.fleet, now=10.0 + CAPACITY_WINDOW_S)
    assert cap.planned_capacity() == 9.0 and 101 * cap.per_student() < PLANNED_LOAD * 9.0
    assert cap.recognition_full() is None


def test_a_worker_gone_drops_its_capacity_at_once():
    cap = _capacity(students=100)
    cap._remember_capacity(Load(100, 2.0, 12.0, 2), now=0.0)
    cap._remember_capacity(Load(100, 2.0, 6.0, 1), now=1.0)
    cap._remember_capacity(Load(100, 2.0, 12.0, 2), now=2.0)  # the second worker back
    assert cap.planned_capacity() == 6.0
    cap.fleet = Load(100, 2.0, 0.0, 0)  # no worker left: nothing to plan on
    cap._remember_capacity(cap.fleet, now=3.0)
    assert cap.planned_capacity() == 0.0
    cap.fleet = Load(100, 2.0, 4.0, 1)  # one back: its first reading counts alone
    cap._remember_capacity(cap.fleet, now=4.0)
    assert cap.planned_capacity() == 4.0


def test_a_class_arriving_before_the_first_beat_is_planned(redis_url):
    """A gateway of a moment ago has not read the fleet's load yet (it beats every second): 60
    students joining at once, with a worker that takes 1 utterance/s, are planned on it all the
    same: at most 0.4 x 1.0 / (0.1 / 5 s) = 20 seated, the rest answered busy. A real gateway app on a
    real Redis; the worker is its heartbeat (no one speaks)."""
    import asyncio

    import aiohttp

    from streamserver.loadsim.clients import create_room, token_of
    from tests.server_process import ADMIN_TOKEN
    from tests.test_seats import gateways, join_status, live_worker, run

    statuses: list[int] = []

    async def body() -> None:
        async with live_worker(redis_url, {"utt_per_s": 0.0, "capacity": 1.0}), \
                gateways(redis_url, n=1, max_students=100) as [(url, _classroom)], aiohttp.ClientSession() as session:
            room = await create_room(session, url, ADMIN_TOKEN, "arriving class", max_students=100)
            token = token_of(room["student_url"])
            statuses.extend(await asyncio.gather(*(join_status(session, url, token, f"arriving-{i:02d}") for i in range(60))))

    run(body)
    # At most the plan's 20: joins on their way count until they are answered, so one refused
    # may keep the last seat of the plan free.
    assert 15 <= statuses.count(200) <= 20 and statuses.count(200) + statuses.count(503) == 60, statuses
