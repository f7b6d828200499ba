"""Aspect buckets: the shapes a resolution allows, the one an image trains in, and the sampler that draws every
batch from one bucket (so its images stack), the same batches on resume and on any number of processes."""
from __future__ import annotations

import math
import random
from collections.abc import Iterator

import torch

from .dataset import DataError, Dataset


def make_buckets(resolution: int, step: int, max_aspect: float) -> list[tuple[int, int]]:
    """(width, height) buckets with sides in multiples of `step`, area at most about resolution^2 and
    aspect at most `max_aspect`; for each height the widest such width is kept. Sorted by aspect."""
    if step < 8 or step % 8:
        raise DataError(f"data.bucket_step={step} must be a positive multiple of 8 (the VAE downsamples by 8)")
    if resolution < step:
        raise DataError(f"resolution {resolution} is smaller than data.bucket_step={step}; lower the step")
    if max_aspect < 1.0:
        raise DataError(f"data.max_aspect={max_aspect} must be at least 1.0 (it bounds long side / short side)")
    side = max(step, round(resolution / step) * step)
    area = side * side
    widest: dict[int, int] = {}  # height -> widest landscape width that fits the area
    w = side
    while True:
        h = (area // w) // step * step
        if h < step or w / h > max_aspect:
            break
        widest[h] = w
        w += step
    buckets = {(w, h) for h, w in widest.items()} | {(h, w) for h, w in widest.items()}
    return sorted(buckets, key=lambda b: (b[0] / b[1], b))


def nearest_bucket(size: tuple[int, int], buckets: list[tuple[int, int]]) -> tuple[int, int]:
    """The bucket whose aspect ratio is closest to the image's, by log-aspect (so 2:1 and 1:2 are
    equally far from 1:1); ties go to the larger bucket."""
    w, h = size
    target = math.log(w / h)
    return min(buckets, key=lambda b: (abs(math.log(b[0] / b[1]) - target), -b[0] * b[1], b))


class BucketBatchSampler(torch.utils.data.Sampler[list[int]]):
    """Batches of positions in `dataset.expanded()`, every batch from one bucket (so they stack).

    Each epoch shuffles within buckets and then the order of batches, from (seed, epoch) alone, so
    a resumed run sees the same batches. With several processes (DDP) the epoch is cut into global
    batches of batch_size x num_replicas, and each global batch is split between the processes: at
    every step they all train on the same bucket, no image comes twice in an epoch, and the global
    batch holds exactly the images one process with batch_size x num_replicas would take at that
    step. A bucket's last, partial global batch is split as evenly as it goes (when it has fewer
    images than processes, its images are repeated so each process has one); drop_last leaves
    partial batches out instead. Positions (skip_next, len) count global batches, so they mean the
    same on any number of processes.
    """

    def __init__(self, dataset: Dataset, batch_size: int, seed: int, num_replicas: int = 1,
                 rank: int = 0, drop_last: bool = False):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be at least 1")
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"rank={rank} must be in 0..{num_replicas - 1}")
        super().__init__()
        self.batch_size = batch_size
        self.global_batch_size = batch_size * num_replicas
        self.seed = seed
        self.num_replicas = num_replicas
        self.rank = rank
        self.drop_last = drop_last
        self.epoch = 0
        self.skip = 0
        groups: dict[tuple[int, int], list[int]] = {}
        for pos, i in enumerate(dataset.expanded()):
            groups.setdefault(dataset.items[i].bucket, []).append(pos)
        self._groups = dict(sorted(groups.items()))
        sizes = [len(g) for g in self._groups.values()]
        if not sizes:
            raise DataError("the dataset has no images to draw batches from")
        gb = self.global_batch_size
        self._total = sum(n // gb if drop_last else -(-n // gb) for n in sizes)
        if self._total < 1:
            raise DataError(f"batch_size={batch_size} x {num_replicas} process(es) with drop_last leaves no full "
                            f"batch (the largest bucket has {max(sizes)} images) — lower train.batch_size or add images")

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def skip_next(self, batches: int) -> None:
        """The next iteration leaves out its first `batches` global batches (resuming mid-epoch). Kept
        apart from set_epoch, which may be called again on every iteration."""
        self.skip = batches

    def __len__(self) -> int:
        return self._total

    def batch_shapes(self) -> list[tuple[tuple[int, int], int]]:
        """(bucket, batch size) of every batch this process can be given: each bucket's full batches and
        its last, partial one (what CUDA graphs capture, one pair per shape)."""
        gb, shapes = self.global_batch_size, set()
        for bucket, positions in self._groups.items():
            n = len(positions)
            sizes = {gb} if n >= gb else set()
            if n % gb and not self.drop_last:
                sizes.add(n % gb)
            shapes |= {(bucket, len(self.share(list(range(size))))) for size in sizes}
        return sorted(shapes)

    def global_batches(self) -> list[list[int]]:
        """The epoch's global batches, in order: the same whatever this process's rank."""
        # A string seed hashes the same in every process (unlike hash() of a tuple).
        rng = random.Random(f"{self.seed}:{self.epoch}")
        batches = []
        for positions in self._groups.values():
            order = list(positions)
            rng.shuffle(order)
            for start in range(0, len(order), self.global_batch_size):
                batch = order[start:start + self.global_batch_size]
                if len(batch) == self.global_batch_size or not self.drop_last:
                    batches.append(batch)
        rng.shuffle(batches)
        return batches

    def share(self, batch: list[int]) -> list[int]:
        """This process's contiguous slice of a global batch (sizes differ by at most one)."""
        n = self.num_replicas
        if len(batch) < n:
            batch = [batch[i % len(batch)] for i in range(n)]
        size, extra = divmod(len(batch), n)
        start = self.rank * size + min(self.rank, extra)
        return batch[start:start + size + (self.rank < extra)]

    def __iter__(self) -> Iterator[list[int]]:
        skip, self.skip = self.skip, 0
        for batch in self.global_batches()[skip:]:
            yield self.share(batch)
