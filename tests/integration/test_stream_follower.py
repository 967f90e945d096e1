"""The Follower in memory (no database, no socket): one reader at a time, bounded catch-up."""

from __future__ import annotations

import asyncio

from tasks.streams import Batch, CloseCode, Follower, Message, SharedReads

WAIT = 5


class FakeStream:
    """Items 1..N in memory; records every read and whether two ever overlapped."""

    def __init__(self, count: int = 0, *, end_after: int | None = None) -> None:
        self.items: list[Message] = [{"seq": n} for n in range(1, count + 1)]
        self.end_after = end_after
        self.reads: list[tuple[int, bool]] = []
        self.reading = 0
        self.overlapped = False
        self.gate: asyncio.Event | None = None  # when set, each read waits on it
        self.stale_upto: int | None = None  # what a read that began earlier (not fresh) could see

    def add(self, count: int) -> None:
        start = len(self.items) + 1
        self.items += [{"seq": n} for n in range(start, start + count)]

    async def read(self, cursor: int, limit: int, fresh: bool) -> Batch:
        self.reading += 1
        self.overlapped |= self.reading > 1
        self.reads.append((cursor, fresh))
        try:
            if self.gate is not None:
                await self.gate.wait()
            visible = self.items if fresh or self.stale_upto is None else self.items[:self.stale_upto]
            items = [item for item in visible if item["seq"] > cursor][:limit]
            ended = self.end_after is not None and items and items[-1]["seq"] == self.end_after
            return Batch(items, {"type": "end", "status": "succeeded", "result_version": 1} if ended else None)
        finally:
            self.reading -= 1


class Client:
    """Collects what the follower sends; lets a test wait for a count."""

    def __init__(self) -> None:
        self.sent: list[Message] = []
        self.changed = asyncio.Event()

    async def send(self, message: Message) -> None:
        self.sent.append(message)
        self.changed.set()

    async def until(self, count: int) -> None:
        async def wait() -> None:
            while len(self.sent) < count:
                self.changed.clear()
                await self.changed.wait()
        await asyncio.wait_for(wait(), WAIT)

    @property
    def seqs(self) -> list[int]:
        return [m["seq"] for m in self.sent if "seq" in m]


def follow(stream: FakeStream, client: Client, **options) -> tuple[Follower, asyncio.Task]:
    follower = Follower(read=stream.read, send=client.send, cursor=options.pop("cursor", 0), poll_s=60, **options)
    return follower, asyncio.create_task(follower.run())


async def stop(task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), WAIT)


async def test_a_burst_of_wakeups_costs_one_read():
    stream, client = FakeStream(2), Client()
    follower, task = follow(stream, client)
    await client.until(2)
    stream.add(3)
    for _ in range(50):
        follower.wake()
    await client.until(5)
    await asyncio.sleep(0)  # let the loop return to waiting, had it wanted a third read
    await stop(task)
    assert client.seqs == [1, 2, 3, 4, 5]
    assert stream.reads == [(0, True), (2, True)]


async def test_a_wakeup_for_what_was_already_sent_costs_no_read():
    stream, client = FakeStream(3), Client()
    follower, task = follow(stream, client)
    await client.until(3)
    follower.wake(2)
    follower.wake(3)
    await asyncio.sleep(0)
    await stop(task)
    assert stream.reads == [(0, True)]


async def test_a_wakeup_naming_its_seq_may_join_a_read_under_way_and_reads_fresh_if_that_missed_it():
    stream, client = FakeStream(1), Client()
    follower, task = follow(stream, client)
    await client.until(1)
    stream.add(2)
    stream.stale_upto = 2  # a read under way began after seq 2 committed and before seq 3 did
    follower.wake(3)
    await client.until(3)  # the follower read again, fresh, without waiting for the poll
    await stop(task)
    assert stream.reads[1:] == [(1, False), (2, True)]
    assert client.seqs == [1, 2, 3]


async def test_a_wakeup_during_a_read_causes_one_more_read_never_an_overlapping_one():
    stream, client = FakeStream(1), Client()
    stream.gate = asyncio.Event()
    follower, task = follow(stream, client)
    await asyncio.sleep(0)  # the first read is now waiting at the gate
    stream.add(2)
    follower.wake()
    follower.wake()
    stream.gate.set()
    await client.until(3)
    await stop(task)
    assert client.seqs == [1, 2, 3]
    assert not stream.overlapped
    assert stream.reads == [(0, True), (3, True)]


async def test_it_asks_a_client_too_far_behind_to_reconnect_after_the_items_it_sent():
    stream, client = FakeStream(10), Client()
    follower = Follower(read=stream.read, send=client.send, cursor=0, poll_s=60, batch_size=2, max_batches_behind=3)
    code = await asyncio.wait_for(follower.run(), WAIT)
    assert code == CloseCode.TOO_FAR_BEHIND
    assert client.seqs == [1, 2, 3, 4, 5, 6]
    assert follower.cursor == 6


async def test_a_client_that_catches_up_within_the_limit_keeps_following():
    stream, client = FakeStream(5), Client()
    follower, task = follow(stream, client, batch_size=2, max_batches_behind=3)
    await client.until(5)
    stream.add(1)
    follower.wake()
    await client.until(6)
    assert not task.done()
    await stop(task)
    assert client.seqs == [1, 2, 3, 4, 5, 6]


async def test_it_sends_the_end_once_after_the_last_item():
    stream, client = FakeStream(3, end_after=3), Client()
    follower, task = follow(stream, client)
    await client.until(4)
    follower.wake()  # reads nothing new: no second end
    stream.add(1)  # a late event is sent as an event
    follower.wake()
    await client.until(5)
    await asyncio.sleep(0)
    await stop(task)
    assert client.sent[3] == {"type": "end", "status": "succeeded", "result_version": 1}
    assert [m.get("seq", "end") for m in client.sent] == [1, 2, 3, "end", 4]


async def test_it_says_end_first_to_a_client_that_has_seen_everything():
    stream, client = FakeStream(3), Client()
    end = {"type": "end", "status": "failed", "result_version": 0}
    follower, task = follow(stream, client, cursor=3, initial_end=end)
    await client.until(1)
    await stop(task)
    assert client.sent == [end]


async def test_a_cancel_that_races_with_a_wakeup_still_stops_it():
    stream, client = FakeStream(1), Client()
    follower, task = follow(stream, client)
    await client.until(1)
    await asyncio.sleep(0)  # now waiting for a wake-up
    follower.wake()
    task.cancel()  # the client left just as news came: the follower must not live on
    done, _ = await asyncio.wait({task}, timeout=WAIT)
    assert task in done and task.cancelled()


# --- shared reads ------------------------------------------------------------------

class CountingReads:
    """A database stand-in: each read returns how many reads had started when it did."""

    def __init__(self) -> None:
        self.started = 0
        self.gate = asyncio.Event()

    async def read(self) -> Batch:
        self.started += 1
        seen = self.started
        await self.gate.wait()
        return Batch([{"seq": seen}])


async def test_followers_at_the_same_cursor_share_one_read():
    shared, db = SharedReads(), CountingReads()
    reads = [asyncio.create_task(shared.read(("task-x", 0, 200), db.read, fresh=True)) for _ in range(10)]
    await asyncio.sleep(0)
    db.gate.set()
    batches = await asyncio.wait_for(asyncio.gather(*reads), WAIT)
    assert db.started == 1
    assert all(batch.items == [{"seq": 1}] for batch in batches)


async def started(db: CountingReads, count: int) -> None:
    while db.started < count:
        await asyncio.sleep(0)


async def test_a_fresh_read_asked_for_during_a_running_one_starts_after_it():
    # The running read may have begun before the commit that woke the newcomer: it must not be joined.
    shared, db = SharedReads(), CountingReads()
    first = asyncio.create_task(shared.read(("task-x", 0, 200), db.read, fresh=True))
    await started(db, 1)
    later = [asyncio.create_task(shared.read(("task-x", 0, 200), db.read, fresh=True)) for _ in range(5)]
    await asyncio.sleep(0)
    db.gate.set()
    assert (await asyncio.wait_for(first, WAIT)).items == [{"seq": 1}]
    assert all(b.items == [{"seq": 2}] for b in await asyncio.wait_for(asyncio.gather(*later), WAIT))
    assert db.started == 2


async def test_a_read_that_need_not_be_fresh_joins_the_running_one():
    shared, db = SharedReads(), CountingReads()
    first = asyncio.create_task(shared.read(("task-x", 0, 200), db.read, fresh=True))
    await started(db, 1)
    joined = asyncio.create_task(shared.read(("task-x", 0, 200), db.read, fresh=False))
    db.gate.set()
    assert (await asyncio.wait_for(joined, WAIT)).items == (await first).items == [{"seq": 1}]
    assert db.started == 1


async def test_a_follower_that_leaves_does_not_cancel_a_read_others_wait_for():
    shared, db = SharedReads(), CountingReads()
    leaving = asyncio.create_task(shared.read(("task-x", 0, 200), db.read, fresh=True))
    staying = asyncio.create_task(shared.read(("task-x", 0, 200), db.read, fresh=True))
    await asyncio.sleep(0)
    leaving.cancel()
    db.gate.set()
    assert (await asyncio.wait_for(staying, WAIT)).items == [{"seq": 1}]
    assert leaving.cancelled()


async def test_reads_at_other_cursors_are_not_shared():
    shared, db = SharedReads(), CountingReads()
    db.gate.set()
    await asyncio.gather(*(shared.read(key, db.read, fresh=True)
                           for key in [("task-x", 0, 200), ("task-x", 5, 200), ("task-y", 0, 200)]))
    assert db.started == 3
