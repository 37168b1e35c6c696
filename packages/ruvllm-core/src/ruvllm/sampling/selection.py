"""Partial selection over a step's logits rows, for the batch sampler (:mod:`ruvllm.sampling.batch`).

The raw rows are read as they are; the few entries penalties, bias and bans change are an
:class:`Overlay` of the reference's exact float64 values. Finding the top candidates of a row takes
one float32 pass of group maxima (token ``t`` is in group ``t % groups``) and reads only the groups
that can hold a candidate again. Everything here is internal to the batch sampler.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ruvllm.sampling.params import SamplingParams
from ruvllm.sampling.reference import Sampler

#: Entries per group in the batch sampler's partial selection. Token ``t`` is in group ``t % groups``
#: (strided), so all group maxima of a [batch, vocab] matrix are one fast reduction.
GROUP = 32


def pad(
    r: np.ndarray, tok: np.ndarray, key: np.ndarray, n: int, limit: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Candidates of ``n`` rows in canonical order (``key`` descending, token ascending), at most
    ``limit`` per row, laid out [n, width]: (index into the inputs, valid mask, count per row)."""
    counts = np.bincount(r, minlength=n)
    take = counts if limit is None else np.minimum(counts, limit)
    j = np.arange(max(int(take.max()), 1))
    valid = j < take[:, None]
    if not r.size:
        return np.zeros(valid.shape, np.int64), valid, take
    starts = np.cumsum(counts) - counts
    src = canonical(r, tok, key)[np.minimum(starts[:, None] + j, r.size - 1)]
    return src, valid, take


def need(take: np.ndarray) -> None:
    """Sampled rows need a candidate: a row whose adjusted logits are all -inf fails."""
    if not take.all():
        raise FloatingPointError("no token has a finite logit")


class Overlay:
    """The entries of a step's rows that differ from the raw logits: keys ``row * width + token``
    (sorted), the reference's float64 adjusted values there (-inf where banned) and the raw ones."""

    def __init__(self, keys: np.ndarray, values: np.ndarray, raw: np.ndarray, width: int) -> None:
        self.keys, self.values, self.raw, self.width = keys, values, raw, width

    def subset(self, keep: np.ndarray) -> Overlay:
        return Overlay(self.keys[keep], self.values[keep], self.raw[keep], self.width)

    def patch(self, keys: np.ndarray, raw: np.ndarray) -> np.ndarray:
        """float64 values at ``keys``: the adjusted ones where there are, else ``raw``."""
        if not self.keys.size:
            return raw.astype(np.float64)
        pos = np.minimum(np.searchsorted(self.keys, keys), self.keys.size - 1)
        return np.where(self.keys[pos] == keys, self.values[pos], raw)

    def row(self, j: int, raw: np.ndarray) -> np.ndarray:
        """Row ``j`` of the adjusted logits in float64, from its raw values ``raw``."""
        out = raw.astype(np.float64)
        lo, hi = np.searchsorted(self.keys, [j * self.width, (j + 1) * self.width])
        out[self.keys[lo:hi] - j * self.width] = self.values[lo:hi]
        return out

    def of_rows(self, rows: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Entries of ``rows`` (of ``n`` rows): (position of the row in ``rows``, token, value, raw value)."""
        at = np.full(n, -1)
        at[rows] = np.arange(len(rows))
        r = at[self.keys // self.width]
        mine = r >= 0
        return r[mine], self.keys[mine] % self.width, self.values[mine], self.raw[mine]


class Rows:
    """A step's logits rows as float32 arrays of ``width`` entries, and as one [rows, width] matrix
    view where they are equally spaced rows of one array (the engine's rows usually are: rows of
    the model's output), so that the passes over them are single operations instead of a loop."""

    def __init__(self, logits: Sequence[np.ndarray], vocab: int, width: int) -> None:
        self.rows = [row32(row, vocab, width) for row in logits]
        self.width, self.groups = width, width // GROUP
        self.matrix = matrix_view(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def at(self, keys: np.ndarray) -> np.ndarray:
        """The entries at sorted ``keys`` (row * width + token)."""
        if self.matrix is not None:
            return self.matrix[keys // self.width, keys % self.width]
        out = np.empty(len(keys), np.float32)
        bounds = np.searchsorted(keys, np.arange(len(self.rows) + 1) * self.width)
        for j in np.flatnonzero(np.diff(bounds)).tolist():
            out[bounds[j] : bounds[j + 1]] = self.rows[j][keys[bounds[j] : bounds[j + 1]] - j * self.width]
        return out

    def take(self, sel: np.ndarray) -> np.ndarray:
        """The rows ``sel`` as one [len(sel), width] array (a view when it is the whole matrix)."""
        if self.matrix is not None:
            return self.matrix if len(sel) == len(self.rows) else self.matrix[sel]
        return np.stack([self.rows[j] for j in sel.tolist()])

    def argmax(self, sel: np.ndarray) -> np.ndarray:
        """The first largest raw entry of each row in ``sel``."""
        if self.matrix is not None and len(sel) == len(self.rows):
            return self.matrix.argmax(axis=1)
        return np.array([unlocked(self.rows[j]).argmax() for j in sel.tolist()], np.int64)

    def replace(self, j: int, row: np.ndarray) -> None:
        self.rows[j] = row
        self.matrix = None

    def group_max(self, sel: np.ndarray) -> np.ndarray:
        """[len(sel), groups]: the maximum of each group (token t is in group t % groups)."""
        if self.matrix is not None and 2 * len(sel) > len(self.rows):
            m3 = self.matrix.reshape(len(self.rows), GROUP, self.groups)
            return (m3 if len(sel) == len(self.rows) else m3[sel]).max(axis=1)
        out = np.empty((len(sel), self.groups), np.float32)
        for i, j in enumerate(sel.tolist()):
            np.max(self.rows[j].reshape(GROUP, self.groups), axis=0, out=out[i])
        return out

    def gather(self, sel: np.ndarray, hit_r: np.ndarray, hit_g: np.ndarray) -> np.ndarray:
        """[len(hit_r), GROUP]: the members of group ``hit_g[i]`` of row ``sel[hit_r[i]]``."""
        if self.matrix is not None:
            return self.matrix.reshape(len(self.rows), GROUP, self.groups)[sel[hit_r], :, hit_g]
        bounds = np.searchsorted(hit_r, np.arange(len(sel) + 1))
        return np.concatenate(
            [
                self.rows[j].reshape(GROUP, self.groups)[:, hit_g[bounds[i] : bounds[i + 1]]].T
                for i, j in enumerate(sel.tolist())
            ]
        )


def matrix_view(rows: list[np.ndarray]) -> np.ndarray | None:
    """The rows as one [n, width] view when they are equally spaced float32 rows of one array (each
    row is a view of it, so the view stays inside its memory); else None."""
    first = rows[0]
    base = first.base
    if base is None or first.dtype != np.float32 or not first.flags.c_contiguous:
        return None
    start = first.ctypes.data
    step = rows[1].ctypes.data - start if len(rows) > 1 else first.nbytes
    if step < first.nbytes:
        return None
    for i, row in enumerate(rows):
        if row.base is not base or row.dtype != np.float32 or row.ctypes.data != start + i * step:
            return None
        if not row.flags.c_contiguous:
            return None
    return unlocked(first, (len(rows), first.size), (step, first.itemsize))


_PLAIN_FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


class _Unlocked:
    """NumPy's array interface to ``array``'s memory, not marked read-only; it holds ``array`` (and
    so the memory) for as long as a view made from it lives."""

    def __init__(self, array: np.ndarray, shape: tuple[int, ...], strides: tuple[int, ...]) -> None:
        self.array = array
        self.__array_interface__ = {
            "shape": shape,
            "typestr": array.dtype.str,
            "data": (array.__array_interface__["data"][0], False),  # (C-level: .ctypes runs Python)
            "strides": strides,
            "version": 3,
        }


def unlocked(
    array: np.ndarray, shape: tuple[int, ...] | None = None, strides: tuple[int, ...] | None = None
) -> np.ndarray:
    """``array`` (or a view of its memory of ``shape`` and ``strides``) not marked read-only, and
    never written. NumPy copies a read-only array before an argmax (the C-contiguous writeable
    input its argmax asks for), and a backend's logits usually are read-only (jax's host arrays
    are): a copy of every row, every step, three times the argmax itself."""
    shape = array.shape if shape is None else shape
    strides = array.strides if strides is None else strides
    if array.flags.writeable and shape == array.shape and strides == array.strides:
        return array
    if array.dtype not in _PLAIN_FLOATS:  # (an extension dtype's typestr does not name it): left locked
        return np.lib.stride_tricks.as_strided(array, shape, strides)
    return np.asarray(_Unlocked(array, shape, strides))


def argmax_rows(logits: np.ndarray) -> np.ndarray:
    """The first largest entry of each row of ``logits`` ([rows, vocab]), as ``logits.argmax(-1)``
    gives it, without NumPy's copy of a read-only array (see :func:`unlocked`)."""
    if logits.ndim == 2 and logits.dtype == np.float32 and logits.flags.c_contiguous:
        logits = unlocked(logits)
    return np.asarray(logits).argmax(axis=-1)


def row32(row: np.ndarray, vocab: int, width: int) -> np.ndarray:
    """A logits row as float32 of ``width`` entries (-inf past the vocabulary): the row itself when it
    already is one, else a converted or padded copy."""
    if np.shape(row) != (vocab,):
        raise ValueError(f"a logits row has shape {np.shape(row)}, expected ({vocab},)")
    if width == vocab:
        return np.ascontiguousarray(row, dtype=np.float32)
    out = np.full(width, -np.inf, np.float32)
    out[:vocab] = row
    return out


def adjustments(samplers: Sequence[Sampler], params: list[SamplingParams], rows: Rows, vocab: int) -> Overlay:
    """Penalties, logit bias and the min_tokens ban as an overlay: the reference's float64 arithmetic
    on the entries they touch, in its order (repetition, presence/frequency, bias, ban)."""
    rep_keys: list[np.ndarray] = []
    rep_len: list[int] = []
    rep_pen: list[float] = []
    pf_keys: list[np.ndarray] = []
    pf_cnt: list[np.ndarray] = []
    pf_len: list[int] = []
    pf_freq: list[float] = []
    pf_pres: list[float] = []
    bias_keys: list[np.ndarray] = []
    bias_vals: list[np.ndarray] = []
    ban_keys: list[int] = []
    width = rows.width
    rep_rows: list[int] = []
    pf_rows: list[int] = []
    bias_rows: list[int] = []
    for j, (s, p) in enumerate(zip(samplers, params, strict=True)):
        ids, cnt = s.produced()
        if p.repetition_penalty != 1.0:
            prompt = s._prompt_ids
            if prompt.size and (prompt[0] < 0 or prompt[-1] >= vocab):
                raise IndexError(f"prompt token ids outside the vocabulary (0..{vocab - 1})")
            rep_keys += [prompt, ids]
            rep_rows += [j, j]
            rep_len.append(prompt.size + ids.size)
            rep_pen.append(p.repetition_penalty)
        if ids.size and (p.presence_penalty or p.frequency_penalty):
            pf_keys.append(ids)
            pf_rows.append(j)
            pf_cnt.append(cnt)
            pf_len.append(ids.size)
            pf_freq.append(p.frequency_penalty)
            pf_pres.append(p.presence_penalty)
        if p.logit_bias:
            bias_ids = np.fromiter((int(t) for t in p.logit_bias), np.int64, len(p.logit_bias))
            if bias_ids.min() < 0 or bias_ids.max() >= vocab:
                raise IndexError(f"logit_bias token ids outside the vocabulary (0..{vocab - 1})")
            bias_keys.append(bias_ids)
            bias_rows.append(j)
            bias_vals.append(np.fromiter(p.logit_bias.values(), np.float64, len(p.logit_bias)))
        if s.generated < p.min_tokens:
            ban_keys += [j * width + t for t in s._banned(vocab)]

    def keyed(tokens: list[np.ndarray], rows: list[int]) -> np.ndarray:
        """Token ids as keys row * width + token (``tokens[i]`` belongs to row ``rows[i]``)."""
        if not tokens:
            return np.empty(0, np.int64)
        return np.concatenate(tokens) + np.repeat(np.array(rows, np.int64) * width, [len(t) for t in tokens])

    every = np.concatenate(
        [keyed(rep_keys, rep_rows), keyed(pf_keys, pf_rows), keyed(bias_keys, bias_rows), np.array(ban_keys, np.int64)]
    )
    if not every.size:
        return Overlay(every, np.empty(0), np.empty(0, np.float32), width)
    # Sorted unique keys, and where each listed key went (one sort instead of a search per list).
    order = np.argsort(every)
    ranked = every[order]
    new = np.concatenate(([True], ranked[1:] != ranked[:-1]))
    keys = ranked[new]
    where = np.empty(len(every), np.int64)
    where[order] = np.cumsum(new) - 1
    raw = rows.at(keys)
    values = raw.astype(np.float64)
    at = 0
    if rep_keys:
        n = sum(rep_len)
        pos = where[at : at + n]
        v = values[pos]
        pen = np.repeat(np.array(rep_pen), rep_len)
        values[pos] = np.where(v > 0, v / pen, v * pen)
        at += n
    if pf_keys:
        n = sum(pf_len)
        freq, pres = np.repeat(np.array(pf_freq), pf_len), np.repeat(np.array(pf_pres), pf_len)
        values[where[at : at + n]] -= freq * np.concatenate(pf_cnt) + pres
        at += n
    if bias_keys:
        n = sum(len(k) for k in bias_keys)
        values[where[at : at + n]] += np.concatenate(bias_vals)
        at += n
    values[where[at:]] = -np.inf
    return Overlay(keys, values, raw, width)


def apply_masks(rows: Rows, masks: Sequence[np.ndarray | None], overlay: Overlay, vocab: int) -> Overlay:
    """The grammar's masks: masked rows become masked copies; where the mask and the min_tokens ban
    leave nothing, the grammar alone decides (the row's penalties and ban are dropped, like the
    reference's fallback). Overlay entries the mask removes are dropped."""
    width = overlay.width
    keep = np.ones(overlay.keys.size, bool)
    for j, mask in enumerate(masks):
        if mask is None:
            continue
        allowed = np.zeros(width, bool)
        n = min(len(mask), vocab)
        allowed[:n] = mask[:n]
        lo, hi = np.searchsorted(overlay.keys, [j * width, (j + 1) * width])
        tok = overlay.keys[lo:hi] - j * width
        usable = allowed & np.isfinite(rows.rows[j])
        usable[tok[np.isneginf(overlay.values[lo:hi])]] = False
        keep[lo:hi] = allowed[tok] if usable.any() else False
        rows.replace(j, np.where(allowed, rows.rows[j], np.float32(-np.inf)))
    return overlay.subset(keep)


class Selection:
    """Partial selection over the adjusted logits of the rows ``sel`` (raw rows plus the overlay),
    from one float32 pass over each raw row.

    Token ``t`` is in group ``t % groups``. A group's raw maximum, raised by the overlay values in it,
    bounds it from above; from below, its raw maximum if the overlay touches nothing in it, else the
    largest overlay value in it. A threshold reached by the k-th largest lower bound is reached by k
    distinct entries, so every one of the k largest is at or above it; only groups whose upper
    bound reaches a threshold are read again (a few dozen per row instead of the vocabulary)."""

    def __init__(self, rows: Rows, sel: np.ndarray, overlay: Overlay, vocab: int) -> None:
        self.rows, self.sel, self.overlay, self.vocab = rows, sel, overlay, vocab
        groups = rows.groups
        # float32 (fast partial selection): overlay values rounded down into lower bounds, up into upper.
        self.high = rows.group_max(sel)
        self.low = self.high.copy()
        self.o_r, self.o_tok, self.o_val, self.o_raw = overlay.of_rows(sel, len(rows))
        if self.o_r.size:
            g = self.o_r * groups + self.o_tok % groups
            v32 = self.o_val.astype(np.float32)
            down = np.where(v32 > self.o_val, np.nextafter(v32, np.float32(-np.inf)), v32)
            up = np.where(v32 < self.o_val, np.nextafter(v32, np.float32(np.inf)), v32)
            self.low.reshape(-1)[g] = -np.inf
            np.maximum.at(self.low.reshape(-1), g, down)
            np.maximum.at(self.high.reshape(-1), g, up)

    def kth(self, k: np.ndarray) -> np.ndarray:
        """Per row, a threshold at or below its k-th largest adjusted logit."""
        groups, width = self.rows.groups, self.rows.width
        thr = np.empty(len(self.sel))
        small = 4 * k <= groups
        for kk in np.unique(k[small]).tolist():  # usually one k for all rows
            if small.all() and (k == kk).all():
                thr[:] = np.partition(self.low, groups - kk, axis=1)[:, groups - kk]
            else:
                at = small & (k == kk)
                thr[at] = np.partition(self.low[at], groups - kk, axis=1)[:, groups - kk]
        for i in np.flatnonzero(~small).tolist():  # k not small against the groups: the exact k-th largest
            j = int(self.sel[i])
            row = self.overlay.row(j, self.rows.rows[j])
            thr[i] = np.partition(row, width - k[i])[width - k[i]]
        return thr

    def collect(self, thr: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The finite entries at or above ``thr`` (per row; +inf skips a row) as (position in
        ``sel``, token, float64 adjusted logit)."""
        groups, width = self.rows.groups, self.rows.width
        # (np.flatnonzero and divmod: np.nonzero of a 2-d array is several times slower)
        hit_r, hit_g = divmod(np.flatnonzero(self.high >= thr[:, None]), groups)
        if 4 * len(hit_r) > self.high.size:  # most groups reach thr: compare whole rows instead
            full = self.rows.take(self.sel)
            r, tok = divmod(np.flatnonzero(full >= thr[:, None]), width)
            raw = full[r, tok]
        else:
            v32 = self.rows.gather(self.sel, hit_r, hit_g)  # [hits, GROUP]
            hi, lane = divmod(np.flatnonzero(v32 >= thr[hit_r, None]), GROUP)
            r, tok, raw = hit_r[hi], lane * groups + hit_g[hi], v32[hi, lane]
        # Entries whose raw value reaches thr (their adjusted value decides), and overlay entries
        # raised to it from below.
        v = self.overlay.patch(self.sel[r] * width + tok, raw)
        o_r, o_val = self.o_r, self.o_val
        raised = (o_val >= thr[o_r]) & (self.o_raw < thr[o_r])
        if raised.any():
            r, tok = np.concatenate((r, o_r[raised])), np.concatenate((tok, self.o_tok[raised]))
            v = np.concatenate((v, o_val[raised]))
        ok = (v >= thr[r]) & (v > -np.inf) & (tok < self.vocab)
        return r[ok], tok[ok], v[ok]


def top_candidates(
    rows: Rows, sel: np.ndarray, k: np.ndarray, overlay: Overlay, vocab: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A superset of the ``k`` largest adjusted logits of each row in ``sel`` (ties included), as
    (position in ``sel``, token, float64 value)."""
    selection = Selection(rows, sel, overlay, vocab)
    return selection.collect(selection.kth(k))


def argmax_adjusted(rows: Rows, sel: np.ndarray, overlay: Overlay, vocab: int) -> np.ndarray:
    """Greedy rows: the first largest adjusted logit, like np.argmax of the reference's row. The raw
    argmax stands unless the overlay changed it or an overlay entry beats it; rows where the overlay
    changed it go through partial selection."""
    width = rows.width
    token = rows.argmax(sel)
    o_r, o_tok, o_val, _ = overlay.of_rows(sel, len(rows))
    if not o_r.size:
        return token
    keys = sel * width + token
    best = rows.at(keys).astype(np.float64)
    pos = np.minimum(np.searchsorted(overlay.keys, keys), overlay.keys.size - 1)
    hard = overlay.keys[pos] == keys
    beat = (o_val > best[o_r]) | ((o_val == best[o_r]) & (o_tok < token[o_r]))
    beat &= ~hard[o_r]
    if beat.any():
        r, t, v = o_r[beat], o_tok[beat], o_val[beat]
        order = np.lexsort((t, -v, r))
        first = order[np.concatenate(([True], r[order][1:] != r[order][:-1]))]
        token[r[first]] = t[first]
    if hard.any():
        at = np.flatnonzero(hard)
        one = np.ones(len(at), np.int64)
        r, t, v = top_candidates(rows, sel[at], one, overlay, vocab)
        src, _, take = pad(r, t, v, len(at), one)
        need(take)
        token[at] = t[src[:, 0]]
    return token


def canonical_order(values: np.ndarray) -> np.ndarray:
    """All ids of a row by value descending, ties by id ascending."""
    return canonical(np.zeros(len(values), np.int64), np.arange(len(values)), values)


def canonical(r: np.ndarray, tok: np.ndarray, key: np.ndarray) -> np.ndarray:
    """The order by row, then key descending, then token: two fast (unstable, SIMD) sorts, one of
    the keys and one of unique integers packing (row, rank of the key, token), where np.lexsort's
    three stable sorts cost ten times as much. Many candidates are sorted row by row (sorts that
    stay in cache)."""
    if len(key) > 1 << 15 and r.max() > r.min():
        by_row = np.argsort(r, kind="stable")
        parts = np.split(by_row, np.flatnonzero(np.diff(r[by_row])) + 1)
        return np.concatenate([p[canonical(np.zeros(len(p), np.int64), tok[p], key[p])] for p in parts])
    by_key = np.argsort(-key)
    sk = key[by_key]
    rank = np.empty(len(key), np.int64)
    rank[by_key] = np.concatenate(([0], np.cumsum(sk[1:] != sk[:-1])))
    tok_bits, rank_bits = int(tok.max()).bit_length(), len(key).bit_length()
    if tok_bits + rank_bits + int(r.max()).bit_length() > 62:
        return np.lexsort((tok, rank, r))
    return np.argsort((r.astype(np.int64) << (rank_bits + tok_bits)) | (rank << tok_bits) | tok)
