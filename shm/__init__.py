"""Shared memory between the scheduler and the workers: the step ring (ring.py) and the staging
buffers (staging.py) that a step's inputs are packed into on the worker."""

# Words in each staging buffer: the most a step may need. The scheduler plans within it without
# importing torch, which staging.py needs.
STAGING_WORDS = 1 << 20
