"""The trainer's memory: its estimate, a job fitted to its GPUs by it, and the CPU probe that checks it."""
