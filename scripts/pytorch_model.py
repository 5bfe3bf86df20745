#!/usr/bin/env python3
"""An independent model of PyTorch's CUDA caching allocator (`c10/cuda/CUDACachingAllocator.cpp`,
`DeviceCachingAllocator::malloc` / `free`) under its default configuration, replaying a tidepool
trace CSV (`seq,op,id,bytes,stream,tag`, gzip or plain). Written from PyTorch's source, not from
tidepool's, to check tidepool's `caching` policy against it.

What it models, as PyTorch does it with no `PYTORCH_CUDA_ALLOC_CONF`:

- `round_size`: requests below 512 B become 512 B, others are rounded up to a multiple of 512 B
  (`roundup_power2_divisions` unset);
- `get_pool`: rounded sizes <= 1 MiB (`kSmallSize`) go to the small pool, others to the large;
- `get_allocation_size`: a new segment is 2 MiB (`kSmallBuffer`) for a small request, 20 MiB
  (`kLargeBuffer`) for one below 10 MiB (`kMinLargeAlloc`), else the request rounded up to
  2 MiB (`kRoundLarge`);
- `get_free_block`: best fit, the `lower_bound` of (stream, size, address) in the pool's ordered
  set of free blocks (the smallest free block of the stream >= the request, lowest address among
  equals); with `max_split_size` unlimited the oversize checks never refuse a block;
- `alloc_block`: a cudaMalloc of the allocation size, counted; addresses come from a bump
  pointer (monotonic, as tidepool's simulated device gives them; they matter only to break ties
  between free blocks of one size);
- `should_split` / `alloc_found_block`: the block is split at its start when the remainder is
  >= 512 B (small pool) or > 1 MiB (large pool; `size < max_split_size` always holds); the
  remainder goes back into the free set;
- `free` / `free_block` / `try_merge_blocks`: a freed block merges with a free previous and a
  free next block of its segment at once (no `record_stream`, so no events: every free is
  immediate; a trace's streams only key the pools).

Statistics kept: reserved bytes (current, peak), cudaMalloc calls (`num_device_alloc`),
allocated bytes (sum of allocated block sizes after rounding and splitting; peak), requested
bytes live (peak).

What it leaves out: the OOM path (memory is unlimited, so `release_available_cached_blocks`,
`release_cached_blocks` and the retry never run and nothing is cudaFree'd), garbage collection,
`max_split_size`, `roundup_power2_divisions`, expandable segments, CUDA graphs and private pools,
`record_stream` and events, `empty_cache`, free-memory callbacks, the per-pool stat breakdown.
Scope markers (`scope_enter`/`scope_exit`) are ignored. Tags (`param`/`act`) are ignored: PyTorch
has no residency.

  scripts/pytorch_model.py TRACE.csv[.gz] [...]     one JSON line per trace
"""
import bisect
import gzip
import json
import sys

K_MIN_BLOCK_SIZE = 512
K_SMALL_SIZE = 1 << 20
K_SMALL_BUFFER = 2 << 20
K_LARGE_BUFFER = 20 << 20
K_MIN_LARGE_ALLOC = 10 << 20
K_ROUND_LARGE = 2 << 20


def round_size(size):
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    return K_MIN_BLOCK_SIZE * ((size + K_MIN_BLOCK_SIZE - 1) // K_MIN_BLOCK_SIZE)


def allocation_size(size):
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return K_ROUND_LARGE * ((size + K_ROUND_LARGE - 1) // K_ROUND_LARGE)


class Block:
    __slots__ = ('ptr', 'size', 'small', 'stream', 'allocated', 'prev', 'next', 'requested')

    def __init__(self, ptr, size, small, stream):
        self.ptr, self.size, self.small, self.stream = ptr, size, small, stream
        self.allocated, self.prev, self.next, self.requested = False, None, None, 0


class Model:
    def __init__(self):
        # (small, stream) -> sorted list of (size, ptr); ptr -> Block for the free blocks.
        self.free_sets = {}
        self.free_blocks = {}
        self.next_addr = 1 << 32
        self.reserved = self.peak_reserved = 0
        self.allocated = self.peak_allocated = 0
        self.requested = self.peak_requested = 0
        self.mallocs = 0
        self.segments = []

    def _set(self, block):
        return self.free_sets.setdefault((block.small, block.stream), [])

    def _insert(self, block):
        bisect.insort(self._set(block), (block.size, block.ptr))
        self.free_blocks[block.ptr] = block

    def _erase(self, block):
        s = self._set(block)
        i = bisect.bisect_left(s, (block.size, block.ptr))
        assert s[i] == (block.size, block.ptr)
        del s[i]
        del self.free_blocks[block.ptr]

    def malloc(self, orig_size, stream):
        size = round_size(orig_size)
        small = size <= K_SMALL_SIZE
        s = self.free_sets.get((small, stream), [])
        i = bisect.bisect_left(s, (size, 0))
        if i < len(s):
            block = self.free_blocks[s[i][1]]
            self._erase(block)
        else:
            alloc = allocation_size(size)
            block = Block(self.next_addr, alloc, small, stream)
            self.next_addr += alloc
            self.mallocs += 1
            self.reserved += alloc
            self.peak_reserved = max(self.peak_reserved, self.reserved)
            self.segments.append(block.ptr)
        remaining = block.size - size
        split = remaining >= K_MIN_BLOCK_SIZE if small else remaining > K_SMALL_SIZE
        if split:
            rest = Block(block.ptr + size, remaining, small, stream)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            self._insert(rest)
        self._hand_out(block, orig_size)
        return block

    def _hand_out(self, block, orig_size):
        """Counts `block` allocated for a request of `orig_size` bytes."""
        block.allocated = True
        block.requested = orig_size
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.requested += orig_size
        self.peak_requested = max(self.peak_requested, self.requested)

    def free(self, block):
        assert block.allocated
        block.allocated = False
        self.allocated -= block.size
        self.requested -= block.requested
        for cand in (block.prev, block.next):
            if cand is None or cand.allocated:
                continue
            self._erase(cand)
            if cand is block.prev:
                block.ptr = cand.ptr
                block.prev = cand.prev
                if block.prev is not None:
                    block.prev.next = block
            else:
                block.next = cand.next
                if block.next is not None:
                    block.next.prev = block
            block.size += cand.size
        self._insert(block)


def open_trace(path):
    with open(path, 'rb') as f:
        gz = f.read(2) == b'\x1f\x8b'
    return gzip.open(path, 'rt') if gz else open(path)


def replay(path):
    m = Model()
    live = {}
    events = 0
    with open_trace(path) as f:
        header = f.readline().strip().split(',')
        col = {name: i for i, name in enumerate(header)}
        for line in f:
            row = line.rstrip('\n').split(',')
            if len(row) < len(header):
                continue
            events += 1
            op = row[col['op']]
            if op == 'alloc':
                live[row[col['id']]] = m.malloc(int(row[col['bytes']]), row[col['stream']])
            elif op == 'free':
                m.free(live.pop(row[col['id']]))
    return {
        'trace': path,
        'events': events,
        'peak_reserved_bytes': m.peak_reserved,
        'device_mallocs': m.mallocs,
        'peak_allocated_bytes': m.peak_allocated,
        'peak_requested_bytes': m.peak_requested,
    }


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for path in sys.argv[1:]:
        print(json.dumps(replay(path)))


if __name__ == '__main__':
    main()
