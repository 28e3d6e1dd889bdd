"""The allreduce path: every rank averages every gradient bucket, through DDP's own allreduce or aiak's hook
(:mod:`.hooks`: flat or hierarchical over :mod:`.topology`'s groups, compressed by :mod:`.compression`, over
several connections of :mod:`.connections`, CPU-Reduce's host stage), the per-bucket state of :mod:`.buckets`,
and the comm autotuner that chooses among them (:mod:`.autotune`, NCCL's sockets advised by
:mod:`.nccl_sockets`, timed in child processes by :mod:`.env_trials`)."""
