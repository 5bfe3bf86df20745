#!/usr/bin/env python3
"""A PyTorch memory snapshot (`torch.cuda.memory._dump_snapshot()` pickle) as a tidepool trace
CSV, for `scripts/expandable_model.py`: the events the replayer's reader makes of it
(`crates/trace/src/read/pytorch_snapshot.rs`), in its order: the blocks live at the snapshot
that the trace never allocated (live throughout), then the blocks the trace frees without having
allocated them (live from the start), then the trace's allocs and frees (`free` where the trace
has it, else `free_requested`). One stream (0) and tag `act`; annotations are left out. Its
peaks under `expandable_model.py '{}'` are the replayer's `caching` + `expandable_segments:true`
(cs336 7069499392, ftcourse 5901385728 bytes).

  scripts/snapshot_to_csv.py SNAPSHOT.pickle OUT.csv.gz [DEVICE]   (default: the first device
                                                                  with a trace, else 0)

The snapshot is a plain pickle of dicts and lists: only load one you trust (pickle runs code).
"""
import gzip
import pickle
import sys


def convert(snapshot, device):
    trace = snapshot['device_traces'][device]
    free = 'free' if any(e['action'] == 'free' for e in trace) else 'free_requested'
    live, body, before, next_id = {}, [], [], 0
    for e in trace:
        if e['action'] == 'alloc':
            live[e['addr']] = (next_id, e['size'])
            body.append(('alloc', next_id, e['size']))
            next_id += 1
        elif e['action'] == free:
            if e['addr'] in live:
                i, size = live.pop(e['addr'])
            else:
                i, size = next_id, e['size']
                before.append(('alloc', i, size))
                next_id += 1
            body.append(('free', i, size))
    at_snapshot = []
    for seg in snapshot['segments']:
        if seg.get('device', device) != device:
            continue
        for b in seg['blocks']:
            if b['state'] not in ('active_allocated', 'active_pending_free'):
                continue
            if b['address'] in live:
                continue
            at_snapshot.append(('alloc', next_id, b.get('requested_size', b['size'])))
            next_id += 1
    return at_snapshot + before + body


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    with open(sys.argv[1], 'rb') as f:
        snapshot = pickle.load(f)
    # The first device with a trace; device 0 where none has one (a snapshot taken without
    # recording history: only its segments' live blocks).
    device = int(sys.argv[3]) if len(sys.argv) > 3 else next(
        (i for i, t in enumerate(snapshot['device_traces']) if t), 0)
    rows = convert(snapshot, device)
    with gzip.open(sys.argv[2], 'wt') as f:
        f.write('seq,op,id,bytes,stream,tag\n')
        for k, (op, i, size) in enumerate(rows):
            f.write('%d,%s,%d,%d,0,act\n' % (k, op, i, size))
    print('%s: %d events' % (sys.argv[2], len(rows)))


if __name__ == '__main__':
    main()
