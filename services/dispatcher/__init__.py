"""dispatcher: answers `polyserve.v1.dispatch` with a Placement on a live worker.

Its state is one `liveview.LiveView`: a live view of workers (heartbeats, TTL expiry,
WorkerDown), its own accounting of what it placed and what finished, the model book of
aladdin/caraserve and per-deployment worker indexes. `handlers` feed it events and ask it
for decisions with the deployment's policy, a pure function from `policy.POLICIES`
(the data policies see is in `views`).
"""

from polyserve.dispatcher import native as _native

# The compiled build of the hot modules when a fresh one is there, else pure Python
# (`native`; before any of them is imported).
_native.install(__path__[0])
