"""Tensor, expert and attention-data parallelism over torch.distributed (one process per rank)."""
