"""Issue 13, nats-pause: when every worker falls silent at once NATS stalled, the workers did not
all die. The dispatcher's registry keeps them placeable during the stall and gives each a TTL from
the stall's end for its heartbeat (queued behind the backlog) to come back; a lone worker falling
silent, or one that stays silent after the stall, expires as before."""
from __future__ import annotations

from polyserve.dispatcher.registry import WorkerRegistry
from polyserve.proto import Heartbeat


class Clock:
    t = 1000.0

    def __call__(self) -> float:
        return self.t


def beat(worker: str) -> Heartbeat:
    return Heartbeat(worker_id=worker, deployment="d", model="m", engine="sim", ttl_s=3.0, ts=1.0)


def ids(reg: WorkerRegistry) -> list[str]:
    return sorted(h.worker_id for h in reg.live("d"))


def test_a_silence_of_every_worker_is_a_stall_not_a_mass_death():
    clock = Clock()
    reg = WorkerRegistry(clock=clock)
    reg.heartbeat(beat("a"))
    reg.heartbeat(beat("b"))
    clock.t += 5.0  # a 5 s NATS pause: no heartbeat from anyone
    assert ids(reg) == ["a", "b"] and reg.sweep() == []
    reg.heartbeat(beat("a"))  # the stall ends; b's heartbeat is still behind the backlog
    for _ in range(2):
        clock.t += 1.0
        reg.heartbeat(beat("a"))
    assert ids(reg) == ["a", "b"], "b gets a TTL from the stall's end"
    clock.t += 1.0
    reg.heartbeat(beat("a"))  # b silent for a TTL after the stall while a is heard: b is gone
    assert ids(reg) == ["a"] and reg.sweep() == ["b"]


def test_one_worker_going_silent_among_others_expires_at_its_ttl():
    clock = Clock()
    reg = WorkerRegistry(clock=clock)
    reg.heartbeat(beat("b"))
    for _ in range(4):  # b dies; a goes on
        reg.heartbeat(beat("a"))
        clock.t += 1.0
    assert ids(reg) == ["a"] and reg.sweep() == ["b"]
