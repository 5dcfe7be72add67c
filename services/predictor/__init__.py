"""predictor: answers `polyserve.v1.predict` with an output-length estimate.

In this version the estimate is Aladdin's historical conditional mean of output
length per input-length bucket (§2.3), learned from `completed` events and kept
in Redis, with a documented prior before any data (see `policy`).
"""
