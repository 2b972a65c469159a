"""Static shapes for CUDA graphs: the KV-length ladder shared by the verifier and the drafter.

A captured graph has fixed shapes, so attention runs over a static key length L >= the
real one, with a mask hiding the rest. A ladder of a few lengths keeps the waste small
without capturing a graph per length.
"""
from __future__ import annotations

import math

KV_ALIGN = 128  # static KV lengths are multiples of this (aligned masks for the attention kernels)
MIN_KV_BUCKET = 256


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def auto_kv_buckets(cache_len: int, max_buckets: int = 8) -> tuple[int, ...]:
    """A geometric ladder (ratio sqrt 2) of static KV lengths, from cache_len down to 256."""
    buckets = {cache_len}
    k = 1
    while len(buckets) < max_buckets:
        length = round_up(math.ceil(cache_len / 2 ** (k / 2)), KV_ALIGN)
        if length < MIN_KV_BUCKET:
            break
        buckets.add(length)
        k += 1
    return tuple(sorted(buckets))
