"""Running: a query set through backends, each query measured and recorded (``runner``), split into shards
(``shard``) that Ray runs across machines (``ray_runner``), or run as interleaved A/B blocks for the gate
(``interleave``).  ``ipw serve``, which meters a client's requests instead, is ``ipw.serve``."""
