"""The request core: requests and their sequences, the scheduler, the block manager, the KV pool,
stop conditions, and the draft tree a step verifies."""
