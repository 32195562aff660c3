"""The scheduler process: queues, batching, the KV block manager and stop checks."""
