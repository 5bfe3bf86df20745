#!/usr/bin/env python3
"""Prints throughput and ratios from the last `cargo bench --bench threads` run (criterion's
estimates under target/criterion/threads/)."""
import json
import pathlib
import sys

root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "target/criterion/threads")
cases = ["1_thread", "2_threads_separate_streams", "2_threads_same_stream"]
threads = {"1_thread": 1, "2_threads_separate_streams": 2, "2_threads_same_stream": 2}
thr = {}
for mode in ["fast", "global_lock"]:
    for case in cases:
        est = json.loads((root / f"{mode}_{case}" / "new" / "estimates.json").read_text())
        ns = est["mean"]["point_estimate"]  # per iteration: one pair on each thread
        thr[(mode, case)] = threads[case] / ns * 1e3  # million pairs per second
        print(f"{mode:12} {case:28} {ns:8.1f} ns/iter  {thr[(mode, case)]:7.2f} M pairs/s")
f1, f2 = thr[("fast", "1_thread")], thr[("fast", "2_threads_separate_streams")]
print(f"fast: 2 threads (separate streams) / 1 thread     = {f2 / f1:.2f}x")
print(f"fast / global_lock at 2 threads, separate streams = "
      f"{f2 / thr[('global_lock', '2_threads_separate_streams')]:.2f}x")
print(f"fast / global_lock at 2 threads, same stream      = "
      f"{thr[('fast', '2_threads_same_stream')] / thr[('global_lock', '2_threads_same_stream')]:.2f}x")
print(f"fast / global_lock at 1 thread                    = "
      f"{f1 / thr[('global_lock', '1_thread')]:.2f}x")
ref = root / "reference_2_threads_2_allocators" / "new" / "estimates.json"
if ref.exists():
    ns = json.loads(ref.read_text())["mean"]["point_estimate"]
    print(f"machine ceiling: 2 threads on 2 allocators / 1 thread = {2 / ns * 1e3 / f1:.2f}x")
