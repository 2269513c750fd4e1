// The fused CPU LoRA delta over paged adapters (built at first use by
// `loraplex_kernels.cpu_lora`).
//
// One call adds the LoRA terms of one fused group for every segment of the step,
// reading the adapters in place from the layer's KV pool (layout: `loraplex_kernels.lora_pages`):
// rank row k of an adapter holds, per wrapped module, A[k, :] then B[:, k] (pre-scaled), and a row
// may straddle the K and V halves of its pages. Work follows each module's own rank (a runtime
// value: no padding to a power of two).
//
// - Work items are (segment, modules, up to 32 rows); items write disjoint rows and columns of `y`,
//   so the threads of `at::parallel_for` pull them from a shared counter, biggest first, with no
//   reduction and no lock.
// - A decode row (or a row left over from a prefill block) walks the rank rows two at a time: per
//   module, `s = x . A[k]` then `y += s * B[k]`, so each module's A and B rows, adjacent in the pool,
//   stream once in address order, read in place (a vector across a half-block boundary is
//   assembled). One item takes all the group's modules, whose spans of a row are adjacent too,
//   unless there are fewer such items than threads. Rows are row_len apart: the rows 8 KiB ahead
//   are prefetched into L2 by software, which the hardware prefetcher does not do across rows.
// - Prefill rows go four at a time per module: every A and B row is resolved once (straddling rows
//   copied to a thread-local scratch), the shrink runs four A rows at a time (AVX-512; two otherwise)
//   vectorised over in_features, so each x load serves four rank rows and each A element four
//   tokens, and sums four accumulators' lanes at once; the expand copies 64 (32, 16) output columns
//   of B into a contiguous panel and keeps those outputs of four rows in registers over the rank loop.
// - Every row gets the same operations in the same order whatever the blocking (the lanes of a dot
//   product are those of a contiguous row, its horizontal sum a fixed tree, multiply-adds fused alike),
//   so a request gets bit-identical LoRA terms alone and inside any batch.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kRowsPerItem = 32;
constexpr int kTokens = 4;  // prefill rows computed together
constexpr int64_t kStreamAhead = 2048;  // floats (8 KiB) a row walk prefetches ahead
constexpr int kSegmentCols = 6;  // row_start, row_end, rank, row_len, page_offset, page_count
constexpr int kModuleCols = 5;  // a_offset, b_offset, rank (0: not wrapped), in, out
constexpr int kModules = 7;
#if defined(__AVX512F__)
constexpr int kRankBlock = 4;  // 4 tokens x 4 A rows of accumulators fit the 32 vector registers
#else
constexpr int kRankBlock = 2;
#endif

// 16 floats in one value: gcc keeps arrays of these in registers where it spills plain float
// arrays, and lowers them to whatever the CPU has (one zmm, two ymm, ...). aligned(4): unaligned loads.
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

inline v16 load16(const float* p) { return *reinterpret_cast<const v16*>(p); }
inline void store16(float* p, v16 v) { *reinterpret_cast<v16*>(p) = v; }
inline void prefetch_l2(const float* p) { __builtin_prefetch(p, 0, 2); }

// a * b + c for the scalar tails, rounded as the vector code rounds it (gcc contracts `v += a * b`
// on vectors to FMA; left to itself it may vectorise a scalar reduction as a multiply, then adds).
inline float fmadd(float a, float b, float c) {
#if defined(__FMA__)
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}

#if defined(__clang__) || __GNUC__ >= 12
// The lanes summed by a fixed tree. (Shuffles, not memcpy: taking the accumulator's address
// would keep it in memory inside the dot loop.)
inline float hsum(v16 v) {
  const v8 s8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 s4 = __builtin_shufflevector(s8, s8, 0, 1, 2, 3) + __builtin_shufflevector(s8, s8, 4, 5, 6, 7);
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

// hsum of four accumulators at once, by the same tree for each (so the same bits as hsum):
// interleaving them lets one shuffle and one add serve several sums.
inline void hsum4(const v16* v, float* out) {
  const v16 ab = __builtin_shufflevector(v[0], v[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                 __builtin_shufflevector(v[0], v[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const v16 cd = __builtin_shufflevector(v[2], v[3], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                 __builtin_shufflevector(v[2], v[3], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const v16 s4 = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                 __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const v8 s2 = __builtin_shufflevector(s4, s4, 0, 1, 4, 5, 8, 9, 12, 13) +
                __builtin_shufflevector(s4, s4, 2, 3, 6, 7, 10, 11, 14, 15);
  const v4 s1 = __builtin_shufflevector(s2, s2, 0, 2, 4, 6) + __builtin_shufflevector(s2, s2, 1, 3, 5, 7);
  for (int r = 0; r < 4; ++r) out[r] = s1[r];
}
#else  // older compilers: the same tree, lane by lane
inline float hsum(v16 v) {
  float s8[8], s4[4];
  for (int l = 0; l < 8; ++l) s8[l] = v[l] + v[l + 8];
  for (int l = 0; l < 4; ++l) s4[l] = s8[l] + s8[l + 4];
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

inline void hsum4(const v16* v, float* out) {
  for (int r = 0; r < 4; ++r) out[r] = hsum(v[r]);
}
#endif

// One layer's pool seen by an adapter: its flat element e is in half-block j = e / half, the K
// block (j even) or V block (j odd) of page pages[j / 2].
struct Pool {
  const float* k;
  const float* v;
  int64_t half;  // elements of one K (or V) block
};

inline const float* half_block(const Pool& p, const int64_t* pages, int64_t j) {
  return ((j & 1) ? p.v : p.k) + pages[j >> 1] * p.half;
}

// One wrapped module of an item.
struct Module {
  int64_t a_off;  // A's row inside the adapter's row
  int64_t b_off;
  int64_t rank;  // the module's rank: rows beyond it are zero and skipped
  int64_t col;  // first column of the module in y
  int64_t out;
};

// `rows` rows from `row` of one segment through `count` modules.
struct Item {
  int64_t row;
  int64_t rows;
  const int64_t* pages;  // the segment's adapter's pages
  int64_t row_len;
  int count;
  Module mods[kModules];
  int64_t cost;
};

struct Rows {
  const float* x;
  int64_t x_stride;
  int64_t in;
  float* y;
  int64_t y_stride;
};

// Where a span begins in successive rank rows: half-block j, offset off. Rows are row_len apart,
// so the walk adds row_len without a division per row.
struct Walk {
  int64_t j;
  int64_t off;
  int64_t step_blocks;
  int64_t step_off;

  Walk() : j(0), off(0), step_blocks(0), step_off(0) {}
  Walk(const Pool& p, int64_t offset, int64_t row_len)
      : j(offset / p.half), off(offset % p.half), step_blocks(row_len / p.half), step_off(row_len % p.half) {}

  void next_row(const Pool& p) {
    off += step_off;
    j += step_blocks + (off >= p.half);
    if (off >= p.half) off -= p.half;
  }
};

// Reads a span of one rank row in place, 16 (or fewer, at the end) elements at a time for
// increasing i: a vector across a half-block boundary is assembled in a small buffer, so the lanes
// are those of a contiguous row.
class SpanReader {
 public:
  SpanReader() = default;
  SpanReader(const Pool& p, const int64_t* pages, const Walk& w)
      : p_(&p), pages_(pages), j_(w.j), piece_(half_block(p, pages, w.j) + w.off), end_(p.half - w.off) {}

  const float* at(int64_t i, int64_t n) {
    if (i + n <= end_) return piece_ + (i - start_);
    for (int64_t done = 0; done < n;) {
      if (i + done == end_) next_piece();
      const int64_t take = std::min(n - done, end_ - (i + done));
      std::memcpy(buffer_ + done, piece_ + (i + done - start_), take * sizeof(float));
      done += take;
    }
    if (i + n == end_) next_piece();
    return buffer_;
  }

  // Where the current piece ends (exclusive), in span coordinates.
  int64_t piece_end() const { return end_; }

  // Where element i is, for increasing i (what a prefetch of the span needs).
  const float* address(int64_t i) {
    if (i >= end_) next_piece();
    return piece_ + (i - start_);
  }

 private:
  void next_piece() {
    start_ = end_;
    end_ += p_->half;
    piece_ = half_block(*p_, pages_, ++j_);
  }

  const Pool* p_ = nullptr;
  const int64_t* pages_ = nullptr;
  int64_t j_ = 0;
  const float* piece_ = nullptr;  // element start_ of the span
  int64_t start_ = 0;
  int64_t end_ = 0;  // the current piece holds elements [start_, end_)
  float buffer_[16];
};

// The span of `len` elements at `w`: in place when it lies in one half-block, else copied to `copy`.
const float* resolve(const Pool& p, const int64_t* pages, const Walk& w, int64_t len, float* copy) {
  if (w.off + len <= p.half) return half_block(p, pages, w.j) + w.off;
  for (int64_t j = w.j, off = w.off, done = 0; done < len; ++j, off = 0) {
    const int64_t n = std::min(len - done, p.half - off);
    std::memcpy(copy + done, half_block(p, pages, j) + off, n * sizeof(float));
    done += n;
  }
  return copy;
}

// ---- one row at a time ----

// Whole vectors from i that lie in one piece for each of the R spans: i + 16 * n <= every piece end.
template <int R>
inline int64_t stretch_end(SpanReader* spans, int64_t i, int64_t len) {
  int64_t stop = i + (len - i) / 16 * 16;
  for (int r = 0; r < R; ++r) stop = std::min(stop, i + (spans[r].piece_end() - i) / 16 * 16);
  return stop;
}

// s[r] = x . A[k + r] for R consecutive rank rows (independent chains, for more work in flight),
// with the operations of shrink_block in the same order for each. The loop runs over stretches
// where every span is contiguous; a vector across a piece boundary is assembled.
template <int R>
inline void dot_rows(const float* __restrict__ x, SpanReader* a, int64_t in, SpanReader* ahead, float* s) {
  v16 acc[R] = {};
  int64_t i = 0;
  while (i + 16 <= in) {
    const int64_t start = i, stop = stretch_end<R>(a, i, in);
    const float* pa[R];
    const float* pf[R];
    for (int r = 0; r < R; ++r) {
      pa[r] = a[r].at(start, 0);
      pf[r] = ahead[r].address(start);
    }
    for (; i < stop; i += 16) {
      const v16 xv = load16(x + i);
      for (int r = 0; r < R; ++r) {
        prefetch_l2(pf[r] + (i - start));
        acc[r] += xv * load16(pa[r] + (i - start));
      }
    }
    if (i + 16 <= in) {  // some span changes piece inside this vector
      const v16 xv = load16(x + i);
      for (int r = 0; r < R; ++r) acc[r] += xv * load16(a[r].at(i, 16));
      i += 16;
    }
  }
  for (int r = 0; r < R; ++r) {
    float sum = hsum(acc[r]);
    if (i < in) {
      const float* tail = a[r].at(i, in - i);
      for (int64_t j = i; j < in; ++j) sum = fmadd(x[j], tail[j - i], sum);
    }
    s[r] = sum;
  }
}

// y += s[0] * B[k] + s[1] * B[k + 1] + ..., in this order for every element (as in expand_rows).
template <int R>
inline void axpy_rows(float* __restrict__ y, const float* s, SpanReader* b, int64_t out, SpanReader* ahead) {
  int64_t o = 0;
  while (o + 16 <= out) {
    const int64_t start = o, stop = stretch_end<R>(b, o, out);
    const float* pb[R];
    const float* pf[R];
    for (int r = 0; r < R; ++r) {
      pb[r] = b[r].at(start, 0);
      pf[r] = ahead[r].address(start);
    }
    for (; o < stop; o += 16) {
      v16 yv = load16(y + o);
      for (int r = 0; r < R; ++r) {
        prefetch_l2(pf[r] + (o - start));
        yv += s[r] * load16(pb[r] + (o - start));
      }
      store16(y + o, yv);
    }
    if (o + 16 <= out) {  // some span changes piece inside this vector
      v16 yv = load16(y + o);
      for (int r = 0; r < R; ++r) yv += s[r] * load16(b[r].at(o, 16));
      store16(y + o, yv);
      o += 16;
    }
  }
  if (o < out)
    for (int r = 0; r < R; ++r) {
      const float* tail = b[r].at(o, out - o);
      for (int64_t j = o; j < out; ++j) y[j] = fmadd(s[r], tail[j - o], y[j]);
    }
}

// Every cache line of a span, into L2.
inline void prefetch_span(SpanReader span, int64_t len) {
  for (int64_t i = 0; i < len; i += 16) prefetch_l2(span.address(i));
}

// Where one module's spans are in the current rank row, and in the row `distance` ahead.
struct ModuleWalk {
  Walk a, b, ahead_a, ahead_b;

  void next_row(const Pool& p) {
    a.next_row(p);
    b.next_row(p);
    ahead_a.next_row(p);
    ahead_b.next_row(p);
  }
};

// The common case of dot_rows, every span contiguous: the same operations on raw pointers.
template <int R>
inline void dot_fast(const float* __restrict__ x, const float* const* a, int64_t in, const float* const* ahead,
                     float* s) {
  v16 acc[R] = {};
  int64_t i = 0;
  for (; i + 16 <= in; i += 16) {
    const v16 xv = load16(x + i);
    for (int r = 0; r < R; ++r) {
      prefetch_l2(ahead[r] + i);
      acc[r] += xv * load16(a[r] + i);
    }
  }
  for (int r = 0; r < R; ++r) {
    float sum = hsum(acc[r]);
    for (int64_t j = i; j < in; ++j) sum = fmadd(x[j], a[r][j], sum);
    s[r] = sum;
  }
}

// The common case of axpy_rows, every span contiguous: the same operations on raw pointers.
template <int R>
inline void axpy_fast(float* __restrict__ y, const float* s, const float* const* b, int64_t out,
                      const float* const* ahead) {
  int64_t o = 0;
  for (; o + 16 <= out; o += 16) {
    v16 yv = load16(y + o);
    for (int r = 0; r < R; ++r) {
      prefetch_l2(ahead[r] + o);
      yv += s[r] * load16(b[r] + o);
    }
    store16(y + o, yv);
  }
  for (int r = 0; r < R; ++r)
    for (int64_t j = o; j < out; ++j) y[j] = fmadd(s[r], b[r][j], y[j]);
}

// R rank rows of one module for one row of x: s = x . A[k..], then y += s . B[k..]. Raw pointers
// when every span lies in one half-block, else span readers.
template <int R>
inline void module_rows(const Item& it, const Rows& m, const Pool& pool, const Module& mod, ModuleWalk& w,
                        bool far, const float* x, float* y) {
  const float *a[R], *b[R], *ahead_a[R], *ahead_b[R];
  ModuleWalk at[R];
  bool contiguous = true;
  for (int r = 0; r < R; ++r, w.next_row(pool)) {
    at[r] = w;
    a[r] = half_block(pool, it.pages, w.a.j) + w.a.off;
    b[r] = half_block(pool, it.pages, w.b.j) + w.b.off;
    // nothing left ahead: prefetch the row itself (its first piece, when the row ahead straddles)
    ahead_a[r] = far ? half_block(pool, it.pages, w.ahead_a.j) + w.ahead_a.off : a[r];
    ahead_b[r] = far ? half_block(pool, it.pages, w.ahead_b.j) + w.ahead_b.off : b[r];
    contiguous &= w.a.off + m.in <= pool.half && w.b.off + mod.out <= pool.half;
  }
  float s[R];
  if (contiguous) {
    dot_fast<R>(x, a, m.in, ahead_a, s);
    axpy_fast<R>(y + mod.col, s, b, mod.out, ahead_b);
    return;
  }
  SpanReader ra[R], rb[R], rpa[R], rpb[R];
  for (int r = 0; r < R; ++r) {
    ra[r] = SpanReader(pool, it.pages, at[r].a);
    rb[r] = SpanReader(pool, it.pages, at[r].b);
    rpa[r] = far ? SpanReader(pool, it.pages, at[r].ahead_a) : ra[r];
    rpb[r] = far ? SpanReader(pool, it.pages, at[r].ahead_b) : rb[r];
  }
  dot_rows<R>(x, ra, m.in, rpa, s);
  axpy_rows<R>(y + mod.col, s, rb, mod.out, rpb);
}

// Row t of the item: rank rows two at a time, each module in turn. The modules' spans of one rank
// row are adjacent, so the item streams its rows in address order.
void run_row(const Item& it, const Rows& m, const Pool& pool, int64_t t) {
  const float* x = m.x + (it.row + t) * m.x_stride;
  float* y = m.y + (it.row + t) * m.y_stride;
  int64_t span = 0, rank = 0;
  for (int u = 0; u < it.count; ++u) {
    span += m.in + it.mods[u].out;
    rank = std::max(rank, it.mods[u].rank);
  }
  const int64_t distance = std::max<int64_t>(2, (kStreamAhead + span - 1) / span);
  ModuleWalk walks[kModules];
  for (int u = 0; u < it.count; ++u) {
    const Walk a(pool, it.mods[u].a_off, it.row_len), b(pool, it.mods[u].b_off, it.row_len);
    walks[u] = {a, b, a, b};
    for (int64_t k = 0; k < distance && k < it.mods[u].rank; ++k) {  // the first rows, all at once
      prefetch_span(SpanReader(pool, it.pages, walks[u].ahead_a), m.in);
      prefetch_span(SpanReader(pool, it.pages, walks[u].ahead_b), it.mods[u].out);
      walks[u].ahead_a.next_row(pool);
      walks[u].ahead_b.next_row(pool);
    }
  }
  for (int64_t k = 0; k < rank; k += 2)
    for (int u = 0; u < it.count; ++u) {
      const Module& mod = it.mods[u];
      const bool far = k + 1 + distance < mod.rank;
      if (k + 1 < mod.rank) {
        module_rows<2>(it, m, pool, mod, walks[u], far, x, y);
      } else if (k < mod.rank) {
        module_rows<1>(it, m, pool, mod, walks[u], far, x, y);
      }
    }
}

// ---- blocks of kTokens rows ----

// s[t * rank + kb] = x[t] . a[kb] for T rows and KB rank rows: each A row streamed once, while
// the rows `ahead` (the next block's, or the first B rows) are prefetched at the same offsets.
template <int T, int KB>
inline void shrink_block(const float* __restrict__ x, int64_t x_stride, int64_t in, const float* const* a,
                         const float* const* ahead, float* __restrict__ s, int64_t rank) {
  v16 acc[T][KB] = {};
  int64_t i = 0;
  for (; i + 16 <= in; i += 16) {
    v16 av[KB];
#pragma GCC unroll 4
    for (int kb = 0; kb < KB; ++kb) {
      prefetch_l2(ahead[kb] + i);
      av[kb] = load16(a[kb] + i);
    }
#pragma GCC unroll 4
    for (int t = 0; t < T; ++t) {
      const v16 xv = load16(x + t * x_stride + i);
#pragma GCC unroll 4
      for (int kb = 0; kb < KB; ++kb) acc[t][kb] += xv * av[kb];
    }
  }
  for (int t = 0; t < T; ++t) {
    float sums[KB];
    if constexpr (KB == 4) {
      hsum4(acc[t], sums);
    } else {
      for (int kb = 0; kb < KB; ++kb) sums[kb] = hsum(acc[t][kb]);
    }
    for (int kb = 0; kb < KB; ++kb) {
      for (int64_t j = i; j < in; ++j) sums[kb] = fmadd(x[t * x_stride + j], a[kb][j], sums[kb]);
      s[t * rank + kb] = sums[kb];
    }
  }
}

// `stream` holds the A rows then the B rows of the module (2 * rank pointers), in reading order.
template <int T>
void shrink(const float* x, int64_t x_stride, int64_t in, const float* const* stream, int64_t rank, float* s) {
  const float* own[kRankBlock];
  int64_t k = 0;
  for (; k + kRankBlock <= rank; k += kRankBlock) {
    const float* const* ahead = stream + k + kRankBlock;
    if (k + 2 * kRankBlock > 2 * rank) {  // the end of the stream: prefetch the block's own rows
      std::copy(stream + k, stream + k + kRankBlock, own);
      ahead = own;
    }
    shrink_block<T, kRankBlock>(x, x_stride, in, stream + k, ahead, s + k, rank);
  }
  for (; k < rank; ++k) shrink_block<T, 1>(x, x_stride, in, stream + k, stream + k + 1, s + k, rank);
}

// y[t, o:o + 16V] += s[t] . B[:, o:o + 16V] for `rows` rows (a multiple of T): the tile's columns
// of B are copied into a contiguous panel (rows row_len apart can alias in L1), then T rows at a
// time keep their 16V outputs in registers over the rank loop, so each panel vector loaded (and
// pinned in a register) serves T rows. Every y[o] receives y[o] + s[0] B[0, o] + s[1] B[1, o] + ...
template <int T, int V>
void expand_tile(const float* __restrict__ s, int64_t rows, int64_t rank, const float* const* b, int64_t o,
                 float* __restrict__ y, int64_t y_stride, float* __restrict__ panel) {
  constexpr int W = 16 * V;
  for (int64_t j = 0; j < rank; ++j) std::memcpy(panel + j * W, b[j] + o, W * sizeof(float));
  for (int64_t t0 = 0; t0 < rows; t0 += T) {
    float* yt = y + t0 * y_stride + o;
    v16 acc[T][V];
    for (int t = 0; t < T; ++t)
      for (int q = 0; q < V; ++q) acc[t][q] = load16(yt + t * y_stride + 16 * q);
    for (int64_t j = 0; j < rank; ++j) {
      v16 p[V];
      for (int q = 0; q < V; ++q) {
        p[q] = load16(panel + j * W + 16 * q);
#if defined(__AVX512F__)
        asm("" : "+v"(p[q]));  // keep it in a register: gcc would reload it for every row
#endif
      }
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) {
        const float stj = s[(t0 + t) * rank + j];
        for (int q = 0; q < V; ++q) acc[t][q] += stj * p[q];
      }
    }
    for (int t = 0; t < T; ++t)
      for (int q = 0; q < V; ++q) store16(yt + t * y_stride + 16 * q, acc[t][q]);
  }
}

// y[t, 0:out] += s[t] . B for `rows` rows (a multiple of T): tiles of 64, then 32, then 16
// outputs, then single columns.
template <int T>
void expand_rows(const float* __restrict__ s, int64_t rows, int64_t rank, const float* const* b, int64_t out,
                 float* __restrict__ y, int64_t y_stride, float* __restrict__ panel) {
  int64_t o = 0;
  for (; o + 64 <= out; o += 64) expand_tile<T, 4>(s, rows, rank, b, o, y, y_stride, panel);
  if (o + 32 <= out) {
    expand_tile<T, 2>(s, rows, rank, b, o, y, y_stride, panel);
    o += 32;
  }
  if (o + 16 <= out) {
    expand_tile<T, 1>(s, rows, rank, b, o, y, y_stride, panel);
    o += 16;
  }
  for (; o < out; ++o)
    for (int64_t t = 0; t < rows; ++t) {
      float acc = y[t * y_stride + o];
      for (int64_t j = 0; j < rank; ++j) acc = fmadd(s[t * rank + j], b[j][o], acc);
      y[t * y_stride + o] = acc;
    }
}

// ptrs[k] = the span [offset, offset + len) of every rank row k (the blocked path reads each
// many times); straddling spans are copied into `scratch`, sized before any pointer into it.
void row_pointers(const Pool& p, const Item& it, int64_t rank, int64_t offset, int64_t len,
                  std::vector<const float*>& ptrs, std::vector<float>& scratch) {
  int64_t copies = 0;
  Walk w(p, offset, it.row_len);
  for (int64_t k = 0; k < rank; ++k, w.next_row(p)) copies += w.off + len > p.half;
  if (static_cast<size_t>(copies * len) > scratch.size()) scratch.resize(copies * len);
  ptrs.resize(rank);
  float* next = scratch.data();
  w = Walk(p, offset, it.row_len);
  for (int64_t k = 0; k < rank; ++k, w.next_row(p)) {
    ptrs[k] = resolve(p, it.pages, w, len, next);
    if (ptrs[k] == next) next += len;
  }
}

// The first `rows` rows of the item (a multiple of kTokens) through module u.
void run_blocked(const Item& it, int u, const Rows& m, const Pool& pool, int64_t rows) {
  thread_local std::vector<const float*> a, b, stream;
  thread_local std::vector<float> a_copies, b_copies, s, panel;
  const Module& mod = it.mods[u];
  row_pointers(pool, it, mod.rank, mod.a_off, m.in, a, a_copies);
  row_pointers(pool, it, mod.rank, mod.b_off, mod.out, b, b_copies);
  stream.assign(a.begin(), a.end());
  stream.insert(stream.end(), b.begin(), b.end());
  s.resize(rows * mod.rank);
  const float* x = m.x + it.row * m.x_stride;
  for (int64_t t = 0; t < rows; t += kTokens)
    shrink<kTokens>(x + t * m.x_stride, m.x_stride, m.in, stream.data(), mod.rank, s.data() + t * mod.rank);
  panel.resize(mod.rank * 64);
  expand_rows<kTokens>(s.data(), rows, mod.rank, b.data(), mod.out, m.y + it.row * m.y_stride + mod.col,
                       m.y_stride, panel.data());
}

void run_item(const Item& it, const Rows& m, const Pool& pool) {
  const int64_t blocked = it.rows / kTokens * kTokens;
  if (blocked)
    for (int u = 0; u < it.count; ++u) run_blocked(it, u, m, pool, blocked);
  for (int64_t t = blocked; t < it.rows; ++t) run_row(it, m, pool, t);
}

// ---- work items ----

// segments: int64 [S, 6 + 7 * 5] (kSegmentCols, then kModuleCols per module); pages: int64 [P],
// each segment's adapter's pages from its page_offset; group: int64 [G, 3] (module, column, out).
// Chunks of fewer than kTokens rows take all the group's modules in one item, unless that leaves
// fewer items than threads.
std::vector<Item> make_items(const at::Tensor& segments, const at::Tensor& pages, const at::Tensor& group,
                             int64_t in, int64_t threads) {
  auto seg = segments.accessor<int64_t, 2>();
  auto grp = group.accessor<int64_t, 2>();
  int64_t small_chunks = 0;
  for (int64_t q = 0; q < seg.size(0); ++q) {
    const int64_t last = (seg[q][1] - seg[q][0]) % kRowsPerItem;  // rows of the segment's last chunk
    small_chunks += last > 0 && last < kTokens;
  }
  const bool together = small_chunks >= threads;
  std::vector<Item> items;
  for (int64_t q = 0; q < seg.size(0); ++q) {
    for (int64_t row = seg[q][0]; row < seg[q][1]; row += kRowsPerItem) {
      const int64_t rows = std::min(kRowsPerItem, seg[q][1] - row);
      Item item{row, rows, pages.data_ptr<int64_t>() + seg[q][4], seg[q][3], 0, {}, 0};
      for (int64_t g = 0; g < grp.size(0); ++g) {
        const int64_t base = kSegmentCols + grp[g][0] * kModuleCols;
        if (seg[q][base + 2] == 0) continue;  // the adapter does not wrap this module
        item.mods[item.count++] = {seg[q][base], seg[q][base + 1], seg[q][base + 2], grp[g][1], grp[g][2]};
        item.cost += rows * seg[q][base + 2] * (in + grp[g][2]);
        if (together && rows < kTokens) continue;
        items.push_back(item);
        item.count = 0;
        item.cost = 0;
      }
      if (item.count) items.push_back(item);
    }
  }
  return items;
}

void check_module(const at::TensorAccessor<int64_t, 1>& seg, int64_t module, int64_t col, int64_t out,
                  const at::Tensor& x, const at::Tensor& y) {
  TORCH_CHECK(module >= 0 && module < kModules, "group module index outside 0..6");
  TORCH_CHECK(col >= 0 && out >= 0 && col + out <= y.size(1), "module columns outside y");
  const int64_t base = kSegmentCols + module * kModuleCols;
  const int64_t a_off = seg[base], b_off = seg[base + 1], rank = seg[base + 2];
  if (rank == 0) return;
  TORCH_CHECK(rank > 0 && rank <= seg[2], "a module's rank exceeds its adapter's");
  TORCH_CHECK(seg[base + 3] == x.size(1) && seg[base + 4] == out, "the adapter's module shape does not fit x, y");
  TORCH_CHECK(a_off >= 0 && a_off + x.size(1) <= seg[3] && b_off >= 0 && b_off + out <= seg[3],
              "module spans outside the adapter's row");
}

void check_segments(const at::Tensor& segments, const at::Tensor& pages, const at::Tensor& group,
                    const at::Tensor& x, const at::Tensor& y, int64_t num_pages, int64_t half) {
  auto seg = segments.accessor<int64_t, 2>();
  auto grp = group.accessor<int64_t, 2>();
  const int64_t* page_ids = pages.data_ptr<int64_t>();
  for (int64_t q = 0; q < seg.size(0); ++q) {
    const int64_t rank = seg[q][2], row_len = seg[q][3], offset = seg[q][4], count = seg[q][5];
    TORCH_CHECK(0 <= seg[q][0] && seg[q][0] <= seg[q][1] && seg[q][1] <= y.size(0), "segment rows outside y");
    TORCH_CHECK(rank >= 0 && row_len >= 0 && offset >= 0 && count >= 0 && offset + count <= pages.size(0),
                "segment pages outside the page table");
    TORCH_CHECK(count * 2 * half >= rank * row_len, "an adapter has fewer pages than its rows need");
    for (int64_t i = offset; i < offset + count; ++i)
      TORCH_CHECK(page_ids[i] >= 0 && page_ids[i] < num_pages, "adapter page outside the pool");
    for (int64_t g = 0; g < grp.size(0); ++g) check_module(seg[q], grp[g][0], grp[g][1], grp[g][2], x, y);
  }
}

void check_args(const at::Tensor& y, const at::Tensor& x, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const at::Tensor& segments, const at::Tensor& pages, const at::Tensor& group) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0), "x [rows, in] and y [rows, out] expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat, "float32 x and y expected");
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1, "x and y rows must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == at::kFloat && v_cache.scalar_type() == at::kFloat && k_cache.is_contiguous()
              && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() && k_cache.dim() >= 1
              && k_cache.size(0) > 0 && k_cache.numel() / k_cache.size(0) >= 16,
              "K and V caches: contiguous float32 tensors of one shape, pages of at least 16 elements");
  TORCH_CHECK(segments.scalar_type() == at::kLong && segments.dim() == 2
              && segments.size(1) == kSegmentCols + kModules * kModuleCols, "segments: int64 [n, 41]");
  TORCH_CHECK(pages.scalar_type() == at::kLong && pages.dim() == 1 && pages.is_contiguous(), "pages: int64 [p]");
  TORCH_CHECK(group.scalar_type() == at::kLong && group.dim() == 2 && group.size(1) == 3 && group.size(0) <= kModules,
              "group: int64 [g <= 7, 3]");
  check_segments(segments, pages, group, x, y, k_cache.size(0), k_cache.numel() / k_cache.size(0));
}

}  // namespace

void lora_delta(at::Tensor y, const at::Tensor& x, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const at::Tensor& segments, const at::Tensor& pages, const at::Tensor& group) {
  check_args(y, x, k_cache, v_cache, segments, pages, group);
  const int64_t threads = at::get_num_threads();
  std::vector<Item> items = make_items(segments, pages, group, x.size(1), threads);
  if (items.empty()) return;
  // biggest first: the threads' shared counter then ends with small items and balances the load
  std::stable_sort(items.begin(), items.end(), [](const Item& l, const Item& r) { return l.cost > r.cost; });
  const Rows m{x.data_ptr<float>(), x.stride(0), x.size(1), y.data_ptr<float>(), y.stride(0)};
  const Pool pool{k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), k_cache.numel() / k_cache.size(0)};
  std::atomic<size_t> next{0};
  auto work = [&](int64_t, int64_t) {
    for (size_t i = next.fetch_add(1); i < items.size(); i = next.fetch_add(1)) run_item(items[i], m, pool);
  };
  const int64_t workers = std::min<int64_t>(threads, items.size());
  if (workers <= 1) {
    work(0, 1);
  } else {
    at::parallel_for(0, workers, 1, work);
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lora_delta", &lora_delta, "y += segmented LoRA delta of x, adapters paged in the KV pool (float32, CPU)",
        py::call_guard<py::gil_scoped_release>());
}
