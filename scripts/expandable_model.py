#!/usr/bin/env python3
"""A model of tidepool's expandable ranges (best fit, the end used last, growth where the fewest
new pages are needed, 2 MiB pages, small/large ranges), to try placement and release policies
on the shipped traces in seconds. It reproduces the allocator's `expandable` peaks exactly
(mlp_train 1411383296, t5_train 1681915904; it has no stream caches, so a page may differ where
`fast_cache` moves a block). Options (JSON):

  reuse          a growth moves the range's own whole free pages instead of creating new ones
  reuse_at_peak  ... only when the range's live bytes reach a new maximum
  stitch         GMLake's stitching, over physical pages mapped at two addresses: where a request
                 of at least `stitch_pages` (8) pages finds no free block, a cached stitched
                 block whose pages are all free serves it, else a new one is made of the range's
                 free pages (lowest first; the range grows at its top for what they lack) and
                 cached: the pages stay mapped in the range, and are taken there while the
                 stitched block is live. Counts the alias maps; physical bytes count once
  stitch_peers   ... borrowing the free pages of the other ranges too (small, and with residency
                 persistent), own pages first; stitch_peers_first: theirs first
  stitch_chunks  ... of whole chunks only (CUDA maps a physical allocation only whole; the model's
                 chunks are its growths, up to `chunk_pages` (32) pages each; growths of fewer
                 than `page_chunks_below` pages are made of single pages)
  stitch_no_grow ... only where free chunks hold all of the request (nothing grown for it)
  stitch_at_peak ... a new stitched block only where the range's live bytes reach a new maximum
  stitch_min_borrow  ... only where free chunks hold at least this share of its pages (0.5)
  stitch_vs_grow ... only where the pages it creates plus this price per borrowed page (0.5)
                 are no more than a growth would create
  threshold      unmap free pages after every free down to this many free bytes (release_threshold)
  high_below     place blocks smaller than this at the high end of their free block
  peer_move      a growth first takes whole free pages the stream's other ranges have mapped
                 (unmapped there) instead of creating new ones; peer_move_at_peak: only where the
                 stream's live bytes reach a new maximum
  split_small    false: one range for small and large blocks
  residency      `param` blocks in ranges of their own; share_small: small ones stay shared;
                 res_cross: a request its own range cannot serve without growing takes a free
                 block of the other residency's range of its pool where one fits
  Placement-driven maps after the first step (2026-12-06; design notes), large ranges only:
  tie_high       best fit takes the highest of the equal-size free blocks (not the lowest)
  near           first fit (lowest address) among free blocks up to (1 + near) x the request
  sliver         best fit skipping blocks that would leave a remainder in (0, sliver) bytes,
                 up to sliver_max x the request (else plain best fit)
  prev_addr      a request takes the address one of the last N freed blocks of its size had,
                 where a free block starts there and holds it
  step_addr      the k-th request of a size takes the address the k-th of that size had in the
                 previous step, where a free block starts there and holds it
  extra_large    a growth at the top of a transient large range maps this many pages more
  align_large    ... and ends at a multiple of this many pages (PyTorch's 20 MiB granule: 10)
  premap         this many pages mapped at the top of the large range as the second step begins
  show_grows     print each growth after the first step (request, free bytes and pieces) to stderr

  scripts/expandable_model.py '{"reuse":1}' [trace names or .csv.gz paths]
  (a PyTorch snapshot first goes through scripts/snapshot_to_csv.py)
  prints x peak live, pages mapped/unmapped per step (the allocator maps a growth in chunks:
  fewer calls than pages)
"""
import gzip, sys, csv  # needs the sortedcontainers package
from sortedcontainers import SortedDict, SortedList

PAGE = 2 << 20
MIB = 1 << 20
UNM, FREE = 'U', 'F'


class Range:
    def __init__(self, size, opts):
        self.size = size
        self.o = opts
        # boundaries: addr -> state ('U', 'F', or ('L', id))
        self.m = SortedDict({0: UNM})
        self.fidx = SortedList()  # (size, addr) of free intervals
        self.mapped = 0
        self.maps = 0
        self.unmaps = 0
        self.live = 0
        self.max_live = 0
        self.chunks = []  # (lo, hi) of each physical allocation, for stitch_chunks
        self.stitches = []  # [pages, live] of each stitched block
        self.peers = []  # the stream's other ranges (stitch_peers)
        self.shared = None  # what the ranges share (peer_move_at_peak), set by run()
        self.kind = ''  # 'S', 'L', 'Sp', 'Lp', set by run()
        self.freed_at = {}  # size -> addresses of freed blocks of that size (prev_addr)
        self.step_addrs = ({}, {}, {}, -1)  # previous step's, this step's, counts, step

    def end_of(self, a):
        i = self.m.index(a)
        return self.m.peekitem(i + 1)[0] if i + 1 < len(self.m) else self.size

    def interval_at(self, x):
        i = self.m.bisect_right(x) - 1
        a, s = self.m.peekitem(i)
        e = self.m.peekitem(i + 1)[0] if i + 1 < len(self.m) else self.size
        return a, e, s

    def _set(self, lo, hi, state):
        # split at lo, hi
        for x in (lo, hi):
            if x < self.size and x not in self.m:
                a, e, s = self.interval_at(x)
                if s == FREE:
                    self.fidx.remove((e - a, a))
                    self.fidx.add((x - a, a))
                    self.fidx.add((e - x, x))
                self.m[x] = s
        # remove inner boundaries
        keys = list(self.m.irange(lo, hi, inclusive=(True, False)))
        for k in keys:
            if self.m[k] == FREE:
                e = self.end_of(k)
                self.fidx.remove((e - k, k))
        for k in keys[1:]:
            del self.m[k]
        self.m[lo] = state
        if state == FREE:
            self.fidx.add((hi - lo, lo))
        # coalesce with neighbours of same (non-live) state
        if state in (FREE, UNM):
            self._merge(lo)

    def _merge(self, lo):
        st = self.m[lo]
        i = self.m.index(lo)
        # right
        if i + 1 < len(self.m):
            r, rs = self.m.peekitem(i + 1)
            if rs == st:
                if st == FREE:
                    re = self.end_of(r)
                    self.fidx.remove((re - r, r))
                    self.fidx.remove((r - lo, lo))
                    self.fidx.add((re - lo, lo))
                del self.m[r]
        if i > 0:
            l, ls = self.m.peekitem(i - 1)
            if ls == st:
                if st == FREE:
                    e = self.end_of(lo)
                    self.fidx.remove((e - lo, lo))
                    self.fidx.remove((lo - l, l))
                    self.fidx.add((e - l, l))
                del self.m[lo]

    def top_free(self):
        """The free interval at the end of the top run, if any."""
        # last mapped interval
        i = len(self.m) - 1
        while i >= 0:
            a, s = self.m.peekitem(i)
            if s != UNM:
                return (a, s) if s == FREE else None
            i -= 1
        return None

    def find_free(self, r):
        j = self.fidx.bisect_left((r, -1))
        if j >= len(self.fidx):
            return None
        sz, a = self.fidx[j]
        if self.kind.startswith('L'):
            sz, a = self.large_fit(r, j, sz, a)
        if self.o.get('end_last', True):
            t = self.top_free()
            if t and t[0] == a:
                j2 = self.fidx.bisect_left((sz + 1, -1))
                if j2 < len(self.fidx):
                    return self.fidx[j2][1]
        return a

    def large_fit(self, r, j, sz, a):
        """The placement rules tried on the large range (tie_high, near, sliver)."""
        t = self.top_free()
        at_end = lambda x: t is not None and t[0] == x
        if self.o.get('tie_high'):
            k = self.fidx.bisect_left((sz + 1, -1)) - 1
            if at_end(self.fidx[k][1]) and k > j:
                k -= 1
            sz, a = self.fidx[k]
        if self.o.get('near') is not None:
            lim = max(r * (1 + self.o['near']), sz)
            cands = [(a2, s2) for s2, a2 in self.fidx.irange((r, -1), (lim, 1 << 62)) if not at_end(a2)]
            if cands:
                a, sz = min(cands)
        if self.o.get('sliver'):
            for s2, a2 in self.fidx.islice(j):
                if (s2 == r or s2 - r >= self.o['sliver']) and not at_end(a2):
                    if s2 <= self.o.get('sliver_max', 1e30) * r:
                        sz, a = s2, a2
                    break
        return sz, a

    def remembered(self, r):
        """An address remembered for a request of `r` bytes (prev_addr, step_addr) where a free
        block starts and holds it."""
        def fits(a):
            b0, e, st = self.interval_at(a)
            return st == FREE and b0 == a and a + r <= e
        if self.o.get('prev_addr'):
            for a in reversed(self.freed_at.get(r, [])[-self.o['prev_addr']:]):
                if fits(a):
                    return a
        if self.o.get('step_addr'):
            prev, cur, counts, step = self.step_addrs
            if step != STEP['step']:
                self.step_addrs = prev, cur, counts, step = cur, {}, {}, STEP['step']
            k = counts.get(r, 0)
            counts[r] = k + 1
            lst = prev.get(r, [])
            if k < len(lst) and fits(lst[k]):
                return lst[k]
        return None

    def alloc_at(self, a, r, bid):
        self._set(a, a + r, ('L', bid))

    def free_block(self, a, r):
        self.live -= r
        if isinstance(a, tuple):
            st = self.stitches[a[1]]
            for rg, p in st[0]:
                rg._set(p, p + PAGE, FREE)
            st[1] = False
            return
        self._set(a, a + r, FREE)
        if self.o.get('prev_addr'):
            h = self.freed_at.setdefault(r, [])
            if a in h:
                h.remove(a)
            h.append(a)

    def place(self, r):
        best = None
        i = 0
        items = list(self.m.items())
        n = len(items)
        for i, (a, s) in enumerate(items):
            if s != UNM:
                continue
            e = items[i + 1][0] if i + 1 < n else self.size
            tail = (a - items[i - 1][0]) if i > 0 and items[i - 1][1] == FREE else 0
            has_next = i + 1 < n
            head = 0
            if has_next and items[i + 1][1] == FREE:
                he = items[i + 2][0] if i + 2 < n else self.size
                head = he - e
            slo, shi = a - tail, e + head
            ws = [slo]
            if has_next and shi - slo >= r:
                ws.append(shi - r)
            for w in ws:
                if w + r > shi or (tail >= r and w == slo):
                    continue
                lo = max(w, a) // PAGE * PAGE
                hi = -(-min(w + r, e) // PAGE) * PAGE
                if hi <= lo:
                    continue
                p = ((hi - lo) // PAGE, lo)
                if best is None or p < best:
                    best = p
        return best

    def free_pages(self, exclude=(0, 0)):
        """Whole free pages (addr) outside [exclude)."""
        out = []
        for sz, a in self.fidx:
            p0 = -(-a // PAGE) * PAGE
            p1 = (a + sz) // PAGE * PAGE
            for p in range(p0, p1, PAGE):
                if not (exclude[0] <= p < exclude[1]):
                    out.append(p)
        return out

    def map(self, lo, hi):
        self._set(lo, hi, FREE)
        cp = 1 if (hi - lo) // PAGE < self.o.get('page_chunks_below', 0) else self.o.get('chunk_pages', 32)
        for c in range(lo, hi, cp * PAGE):
            self.chunks.append((c, min(hi, c + cp * PAGE)))
        n = (hi - lo) // PAGE
        self.mapped += n * PAGE
        self.maps += n

    def unmap(self, p):
        self._set(p, p + PAGE, UNM)
        self.mapped -= PAGE
        self.unmaps += 1

    def grow(self, r):
        pages, lo = self.place(r)
        hi = lo + pages * PAGE
        if self.kind == 'L' and hi >= self.top_mapped():
            hi += self.o.get('extra_large', 0) * PAGE
            al = self.o.get('align_large', 0) * PAGE
            if al:
                hi = -(-hi // al) * al
            pages = (hi - lo) // PAGE
        if self.o.get('reuse') and (not self.o.get('reuse_at_peak') or self.live + r > self.max_live):
            # move own whole free pages (outside the window) here instead of creating
            fp = self.free_pages()
            xlo, xhi = lo, hi
            if lo > 0:
                a, e, st = self.interval_at(lo - 1)
                if st == FREE: xlo = a
            if hi < self.size:
                a, e, st = self.interval_at(hi)
                if st == FREE: xhi = e
            fp = [p for p in fp if not (xlo <= p < xhi)]
            order = self.o.get('reuse_order', 'high')
            fp.sort(reverse=(order == 'high'))
            for p in fp[:pages]:
                self.unmap(p)
        if self.o.get('peer_move') and (not self.o.get('peer_move_at_peak') or self.at_peak(r)):
            # take whole free pages the stream's other ranges have mapped instead of creating
            # new ones (unmapped there, mapped here: the physical pages move)
            left = pages
            for rg in self.peers:
                for p in sorted(rg.free_pages(), reverse=True)[:left]:
                    rg.unmap(p)
                    left -= 1
        self.map(lo, hi)
        # the free interval holding lo
        a, e, s = self.interval_at(lo)
        assert s == FREE and e - a >= r, (a, e, s, r)
        return a

    def at_peak(self, r):
        """Whether `r` more bytes take the stream's live bytes to a new maximum."""
        return self.live + r + sum(rg.live for rg in self.peers) > self.shared['max_live']

    def pages_free(self, pages):
        for p in pages:
            a, e, st = self.interval_at(p)
            if st != FREE or e < p + PAGE:
                return False
        return True

    def top_mapped(self):
        i = len(self.m) - 1
        while i > 0 and self.m.peekitem(i)[1] == UNM:
            i -= 1
        return self.m.peekitem(i + 1)[0] if i + 1 < len(self.m) else self.size

    def stitch(self, r):
        """A stitched block for `r` bytes (its index), or None. Its pages are (range, address)
        pairs: this range's, and with `stitch_peers` the free pages of the stream's other
        ranges too (`self.peers`)."""
        need = -(-r // PAGE)
        if need < self.o.get("stitch_pages", 8):
            return None
        free = lambda pages: all(rg.pages_free([p]) for rg, p in pages)
        fits = [i for i, (pages, live) in enumerate(self.stitches)
                if not live and len(pages) >= need and free(pages)]
        if fits:
            i = min(fits, key=lambda i: len(self.stitches[i][0]))
        else:
            if self.o.get('stitch_at_peak') and self.live + r <= self.max_live:
                return None
            if self.o.get('stitch_chunks'):
                pages = []
                for lo, hi in sorted(self.chunks):
                    run = list(range(lo, hi, PAGE))
                    if len(pages) + len(run) <= need and self.pages_free(run):
                        pages += [(self, p) for p in run]
            else:
                donors = [self] + (self.peers if self.o.get('stitch_peers') else [])
                if self.o.get('stitch_peers_first'):
                    donors = donors[1:] + donors[:1]
                pages = [(rg, p) for rg in donors for p in sorted(rg.free_pages())][:need]
            if not pages:
                return None
            if len(pages) < need and self.o.get('stitch_no_grow'):
                return None
            if len(pages) < self.o.get('stitch_min_borrow', 0) * need:
                return None
            if self.o.get('stitch_vs_grow') is not None:
                # the pages a growth would create, against those the stitch creates plus a
                # price per page it borrows
                if need - len(pages) + self.o['stitch_vs_grow'] * len(pages) > self.place(r)[0]:
                    return None
            if len(pages) < need:
                top = self.top_mapped()
                self.map(top, top + (need - len(pages)) * PAGE)
                pages += [(self, top + k * PAGE) for k in range(need - len(pages))]
            self.maps += len(pages)  # the alias mappings
            self.stitches.append([pages, False])
            i = len(self.stitches) - 1
        for rg, p in self.stitches[i][0]:
            rg._set(p, p + PAGE, ('L', 'stitch'))
        self.stitches[i][1] = True
        return i

    def alloc(self, r, bid):
        a = self.remembered(r) if self.kind.startswith('L') else None
        if a is not None:
            self.alloc_at(a, r, bid)
            self.live += r
            self.max_live = max(self.max_live, self.live)
            self.note_step_addr(r, a)
            return a
        a = self.find_free(r)
        if a is None and self.o.get('show_grows') and STEP['step'] >= 1:
            fr = sorted((sz for sz, _ in self.fidx), reverse=True)
            print('grow: step %d seq %s range %s request %d live %d (max %d) free %d in %d pieces, '
                  'largest %s; pages %s' % (STEP['step'] + 1, STEP['seq'], self.kind, r, self.live,
                                            self.max_live, sum(fr), len(fr), fr[:4], self.place(r)),
                  file=sys.stderr)
        if a is None and (self.o.get('stitch') or self.o.get('stitch_chunks')):
            i = self.stitch(r)
            if i is not None:
                self.live += r
                self.max_live = max(self.max_live, self.live)
                return ('stitch', i)
        if a is None:
            a = self.grow(r)
        hi = self.o.get('high_below')
        if hi is not None and r < hi:
            a0, e, s = self.interval_at(a)
            a = e - r
        self.alloc_at(a, r, bid)
        self.live += r
        self.max_live = max(self.max_live, self.live)
        self.note_step_addr(r, a)
        return a

    def note_step_addr(self, r, a):
        if self.o.get('step_addr') and self.kind.startswith('L') and not isinstance(a, tuple):
            self.step_addrs[1].setdefault(r, []).append(a)

    def release_free(self, keep=0):
        fp = self.free_pages()
        for p in sorted(fp, reverse=True):
            if self.free_bytes() <= keep:
                break
            self.unmap(p)

    def free_bytes(self):
        return sum(s for s, _ in self.fidx)


STEP = {'step': 0, 'seq': ''}  # the step under way (0: the first) and the event, for the rules


def round512(b):
    return max(512, (b + 511) // 512 * 512)


def run(path, opts):
    rows = csv.reader(gzip.open(path, 'rt'))
    next(rows)
    ranges = {}
    shared = {'max_live': 0}  # the ranges' live bytes at their largest (peer_move_at_peak)
    blocks = {}
    live = peak_live = 0
    peak_mapped = 0
    steps = []
    mark = (0, 0)
    STEP.update(step=0, seq='')
    for seq, op, id_, b, stream, tag in rows:
        b = int(b)
        STEP['seq'] = seq
        if op == 'alloc':
            r = round512(b)
            kind = 'S' if r <= MIB and opts.get('split_small', True) else 'L'
            if opts.get('residency') and tag == 'param' and opts.get('pers_one'):
                kind = 'L'
            if opts.get('residency') and tag == 'param' and not (kind == 'S' and opts.get('share_small')):
                kind += 'p'
            if kind not in ranges:
                ranges[kind] = Range(1 << 44, opts)
                ranges[kind].kind = kind
                ranges[kind].shared = shared
                for k, x in ranges.items():
                    x.peers = [y for j, y in ranges.items() if j != k]
            rg = ranges[kind]
            if opts.get('res_cross') and rg.find_free(r) is None:
                # The other residency's range of the same pool, where it has a free block that
                # fits: taken there instead of growing this one.
                other = ranges.get(kind[:-1] if kind.endswith('p') else kind + 'p')
                if other is not None and other.find_free(r) is not None:
                    rg, kind = other, other.kind
            a = rg.alloc(r, id_)
            if opts.get('peer_move_at_peak'):
                shared['max_live'] = max(shared['max_live'], sum(x.live for x in ranges.values()))
            blocks[id_] = (kind, a, r)
            live += b
            peak_live = max(peak_live, live)
        elif op == 'free':
            kind, a, r = blocks.pop(id_)
            ranges[kind].free_block(a, r)
            live -= b
            if opts.get('threshold') is not None:
                ranges[kind].release_free(opts['threshold'])
        elif op == 'scope_enter' and opts.get('premap') and len(steps) == 1 and 'L' in ranges:
            top = ranges['L'].top_mapped()
            ranges['L'].map(top, top + opts['premap'] * PAGE)
        elif op == 'scope_exit':
            STEP['step'] += 1
            m = sum(x.maps for x in ranges.values()), sum(x.unmaps for x in ranges.values())
            steps.append('%d/%d' % (m[0] - mark[0], m[1] - mark[1]))
            mark = m
        mapped = sum(x.mapped for x in ranges.values())
        peak_mapped = max(peak_mapped, mapped)
    return peak_live, peak_mapped, steps


if __name__ == '__main__':
    import json
    opts = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    files = sys.argv[2:] or ['mlp_train', 'gpt2_train', 'mobilenetv2_train', 'vit_train', 't5_train', 'llama_decode']
    for f in files:
        import os
        here = os.path.dirname(os.path.abspath(__file__))
        # A trace name of data/traces, or a path (e.g. the variants of scripts/trace-variants).
        path = f if f.endswith('.csv.gz') else os.path.join(here, '..', 'data', 'traces', '%s.csv.gz' % f)
        name = os.path.basename(path)[:-len('.csv.gz')]
        pl, pm, steps = run(path, opts)
        print('%-18s live %11d mapped %11d  x %.4f  steps %s' % (name, pl, pm, pm / pl, ' '.join(steps)))
