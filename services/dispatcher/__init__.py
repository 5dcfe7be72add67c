"""dispatcher: answers `polyserve.v1.dispatch` with a Placement on a live worker.

It keeps a live view of workers (heartbeats, TTL expiry, WorkerDown) plus its own
accounting of what it placed and what finished, and applies the deployment's
policy, a pure function from `policy.POLICIES`.
"""
