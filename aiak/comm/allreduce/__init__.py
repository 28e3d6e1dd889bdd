"""The allreduce path: every rank averages every gradient bucket, through DDP's own allreduce or aiak's hook
(`hooks`: flat or hierarchical over `topology`'s groups, compressed by `compression`, over
several connections of `connections`, CPU-Reduce's host stage), the per-bucket state of `buckets`,
and the comm autotuner that chooses among them (`autotune`, NCCL's sockets advised by
`nccl_sockets`, timed in child processes by `env_trials`)."""
