"""Tensor parallelism inside one worker: one process per rank, rank 0 drives.

``shard_plan`` says which slice of each dense tensor a rank holds and what the per-rank model
shape is; ``rank_group`` wraps torch.distributed (gloo on CPU, NCCL on CUDA) and the control
channel; ``ranks`` starts and watches the follower processes; ``follower`` is their loop;
``kv_gather`` shows the sharded KV to the KV store in the one-rank layout. With a tensor-parallel
size of 1 nothing here is imported and the engine runs as it always did.
"""
