"""C++ source of the fused CPU LoRA delta (built at first use by `loraplex_kernels.cpu_lora`).

Kept as a Python string so that it ships with the package like any module (package data holds
no .cpp files). One call adds the LoRA terms of one fused group for every run of the step:

- work items are (segment, wrapped module, up to 32 rows); items write disjoint rows and columns
  of `y`, so the threads of `at::parallel_for` pull them from a shared counter, biggest first, with
  no reduction and no lock;
- a decode row streams the adapter's A `[in, R]` row by row (`s += x[i] * A[i, :]`, vectorised
  over the rank R, a template constant for powers of two up to 128 so `s` stays in registers), then
  B `[R, out]` row by row (`y += s[j] * B[j, :]`, vectorised over the outputs, y in L1). Each weight
  byte is read once, in address order; software prefetch runs 1 KiB ahead of each stream and warms
  the start of B while A streams, which took a decode step with 32 adapters from ~14 to ~18 GB/s on
  one core (a plain sum over the same bytes: ~20 GB/s);
- prefill rows go four at a time (two for R = 128): A rows serve four tokens, and the expand copies
  32 output columns of B into a contiguous panel, then keeps those 32 outputs of four rows in
  registers over the rank loop, so a panel element serves four tokens. Every row gets the same
  operations in the same order whatever the blocking, so a request gets bit-identical LoRA terms
  alone and inside any batch (ranks that are no template constant run one row at a time).
"""

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <vector>

namespace {

constexpr int64_t kRowsPerItem = 32;
constexpr int64_t kAhead = 256;  // floats (1 KiB) of software prefetch ahead of a weight stream
constexpr int64_t kRampB = 2048;  // floats of B prefetched while A streams, so B starts warm

// `rows` rows from `row` of one segment through one wrapped module.
struct Item {
  int64_t row;
  int64_t rows;
  const float* a;  // [in, rank]
  const float* b;  // [rank, out]
  int64_t rank;
  int64_t out;
  int64_t col;  // first column of the module in y
  int64_t cost;
};

struct Rows {
  const float* x;
  int64_t x_stride;
  int64_t in;
  float* y;
  int64_t y_stride;
};

// 16 floats in one value: gcc keeps arrays of these in registers where it spills plain float
// arrays, and lowers them to whatever the CPU has (one zmm, two ymm, ...). aligned(4): unaligned loads.
typedef float v16 __attribute__((vector_size(64), aligned(4)));

inline v16 load16(const float* p) { return *reinterpret_cast<const v16*>(p); }
inline void store16(float* p, v16 v) { *reinterpret_cast<v16*>(p) = v; }

// s[t][0:R] = x[t] . A for T rows: A streamed once, row by row, the sums in registers.
template <int R, int T>
inline void shrink_fixed(const float* __restrict__ x, int64_t x_stride, int64_t in,
                         const float* __restrict__ a, const float* b, float* __restrict__ s) {
  if constexpr (R >= 16) {
    constexpr int Q = R / 16;
    v16 acc[T][Q] = {};
    for (int64_t i = 0; i < in; ++i) {
      const float* a_row = a + i * R;
      __builtin_prefetch(a_row + kAhead);
      if (i * 16 < kRampB) __builtin_prefetch(b + i * 16);
      v16 av[Q];
#pragma GCC unroll 8
      for (int q = 0; q < Q; ++q) av[q] = load16(a_row + 16 * q);
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) {
        const float xv = x[t * x_stride + i];
#pragma GCC unroll 8
        for (int q = 0; q < Q; ++q) acc[t][q] += xv * av[q];
      }
    }
    for (int t = 0; t < T; ++t)
      for (int q = 0; q < Q; ++q) store16(s + t * R + 16 * q, acc[t][q]);
  } else {  // ranks below 16: a few bytes per adapter, plain loops
    float acc[T][R] = {};
    for (int64_t i = 0; i < in; ++i) {
      const float* a_row = a + i * R;
      __builtin_prefetch(a_row + kAhead);
      if (i * 16 < kRampB) __builtin_prefetch(b + i * 16);
      for (int t = 0; t < T; ++t) {
        const float xv = x[t * x_stride + i];
        for (int j = 0; j < R; ++j) acc[t][j] += xv * a_row[j];
      }
    }
    for (int t = 0; t < T; ++t)
      for (int j = 0; j < R; ++j) s[t * R + j] = acc[t][j];
  }
}

// y[0:out] += s . B for one row: B streamed once, row by row; y stays in L1.
// Every y[o] receives y[o] + s[0] B[0, o] + s[1] B[1, o] + ... in this order (as in expand_block).
inline void expand_row(const float* __restrict__ s, int64_t rank, const float* __restrict__ b, int64_t out,
                       float* __restrict__ y) {
  for (int64_t j = 0; j < rank; ++j) {
    const float sj = s[j];
    const float* bj = b + j * out;
    int64_t o = 0;
    for (; o + 16 <= out; o += 16) {
      __builtin_prefetch(bj + o + kAhead);
      store16(y + o, load16(y + o) + sj * load16(bj + o));
    }
    for (; o < out; ++o) y[o] += sj * bj[o];
  }
}

// y[t, 0:out] += s[t] . B for `rows` rows (a multiple of T). Per tile of W outputs, the tile's
// B columns are copied into a contiguous panel (B's rows are `out` floats apart, which for out =
// 1024 puts them all in one L1 set), then T rows at a time keep their W outputs in registers over
// the rank loop, so each panel element loaded serves T rows.
template <int R, int T>
inline void expand_rows(const float* __restrict__ s, int64_t rows, const float* __restrict__ b, int64_t out,
                        float* __restrict__ y, int64_t y_stride) {
  constexpr int W = 32;
  alignas(64) float panel[R * W];
  int64_t o = 0;
  for (; o + W <= out; o += W) {
    for (int j = 0; j < R; ++j)
      for (int k = 0; k < W; ++k) panel[j * W + k] = b[j * out + o + k];
    for (int64_t t0 = 0; t0 < rows; t0 += T) {
      float* yt = y + t0 * y_stride + o;
      v16 lo[T], hi[T];
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) {
        lo[t] = load16(yt + t * y_stride);
        hi[t] = load16(yt + t * y_stride + 16);
      }
      for (int j = 0; j < R; ++j) {
        const v16 p_lo = load16(panel + j * W), p_hi = load16(panel + j * W + 16);
#pragma GCC unroll 4
        for (int t = 0; t < T; ++t) {
          const float stj = s[(t0 + t) * R + j];
          lo[t] += stj * p_lo;
          hi[t] += stj * p_hi;
        }
      }
#pragma GCC unroll 4
      for (int t = 0; t < T; ++t) {
        store16(yt + t * y_stride, lo[t]);
        store16(yt + t * y_stride + 16, hi[t]);
      }
    }
  }
  for (; o < out; ++o)
    for (int64_t t = 0; t < rows; ++t) {
      float acc = y[t * y_stride + o];
      for (int j = 0; j < R; ++j) acc += s[t * R + j] * b[j * out + o];
      y[t * y_stride + o] = acc;
    }
}

template <int R>
void run_fixed(const Item& it, const Rows& m) {
  constexpr int T = R >= 128 ? 2 : 4;
  float s[kRowsPerItem * R];
  const float* x = m.x + it.row * m.x_stride;
  float* y = m.y + it.row * m.y_stride + it.col;
  const int64_t blocked = it.rows / T * T;
  for (int64_t t = 0; t < blocked; t += T) shrink_fixed<R, T>(x + t * m.x_stride, m.x_stride, m.in, it.a, it.b, s + t * R);
  if (blocked) expand_rows<R, T>(s, blocked, it.b, it.out, y, m.y_stride);
  for (int64_t t = blocked; t < it.rows; ++t) {
    shrink_fixed<R, 1>(x + t * m.x_stride, m.x_stride, m.in, it.a, it.b, s);
    expand_row(s, R, it.b, it.out, y + t * m.y_stride);
  }
}

// The same for a rank that is no template constant: one row at a time, sums in memory.
void run_any(const Item& it, const Rows& m) {
  std::vector<float> s(it.rank);
  for (int64_t t = 0; t < it.rows; ++t) {
    const float* x = m.x + (it.row + t) * m.x_stride;
    std::fill(s.begin(), s.end(), 0.0f);
    for (int64_t i = 0; i < m.in; ++i) {
      const float* a_row = it.a + i * it.rank;
      for (int64_t j = 0; j < it.rank; ++j) s[j] += x[i] * a_row[j];
    }
    expand_row(s.data(), it.rank, it.b, it.out, m.y + (it.row + t) * m.y_stride + it.col);
  }
}

void run_item(const Item& it, const Rows& m) {
  switch (it.rank) {
    case 1: return run_fixed<1>(it, m);
    case 2: return run_fixed<2>(it, m);
    case 4: return run_fixed<4>(it, m);
    case 8: return run_fixed<8>(it, m);
    case 16: return run_fixed<16>(it, m);
    case 32: return run_fixed<32>(it, m);
    case 64: return run_fixed<64>(it, m);
    case 128: return run_fixed<128>(it, m);
    default: return run_any(it, m);
  }
}

// runs: int64 [n, 5] (row_start, tokens, num_segments, rank, index_start);
// entries: int64 [e, 3] (rank, col, out) with a[e] [capacity, in, rank], b[e] [capacity, rank, out].
std::vector<Item> make_items(const at::Tensor& runs, const at::Tensor& entries,
                             const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b, int64_t in) {
  auto run = runs.accessor<int64_t, 2>();
  auto entry = entries.accessor<int64_t, 2>();
  std::vector<Item> items;
  for (int64_t q = 0; q < run.size(0); ++q) {
    const int64_t row_start = run[q][0], tokens = run[q][1], segments = run[q][2], rank = run[q][3];
    const int64_t index_start = run[q][4];
    for (int64_t e = 0; e < entry.size(0); ++e) {
      if (entry[e][0] != rank) continue;
      const int64_t col = entry[e][1], out = entry[e][2];
      TORCH_CHECK(index_start + segments <= a[e].size(0), "LoRA run reads past the stacked buffers");
      const float* a_base = a[e].data_ptr<float>();
      const float* b_base = b[e].data_ptr<float>();
      for (int64_t k = 0; k < segments; ++k) {
        const int64_t index = index_start + k;
        for (int64_t t = 0; t < tokens; t += kRowsPerItem) {
          const int64_t rows = std::min(kRowsPerItem, tokens - t);
          items.push_back({row_start + k * tokens + t, rows, a_base + index * in * rank,
                           b_base + index * rank * out, rank, out, col, rows * rank * (in + out)});
        }
      }
    }
  }
  return items;
}

void check_args(const at::Tensor& y, const at::Tensor& x, const at::Tensor& runs, const at::Tensor& entries,
                const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0), "x [rows, in] and y [rows, out] expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat && y.scalar_type() == at::kFloat, "float32 x and y expected");
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1, "x and y rows must be contiguous");
  TORCH_CHECK(runs.scalar_type() == at::kLong && runs.dim() == 2 && runs.size(1) == 5, "runs: int64 [n, 5]");
  TORCH_CHECK(entries.scalar_type() == at::kLong && entries.dim() == 2 && entries.size(1) == 3,
              "entries: int64 [e, 3]");
  TORCH_CHECK(a.size() == static_cast<size_t>(entries.size(0)) && b.size() == a.size(), "one A and B per entry");
  auto entry = entries.accessor<int64_t, 2>();
  for (size_t e = 0; e < a.size(); ++e) {
    const int64_t rank = entry[e][0], col = entry[e][1], out = entry[e][2];
    TORCH_CHECK(a[e].is_contiguous() && b[e].is_contiguous() && a[e].scalar_type() == at::kFloat &&
                b[e].scalar_type() == at::kFloat, "stacked LoRA buffers must be contiguous float32");
    TORCH_CHECK(a[e].dim() == 3 && a[e].size(1) == x.size(1) && a[e].size(2) == rank, "A: [capacity, in, rank]");
    TORCH_CHECK(b[e].dim() == 3 && b[e].size(0) == a[e].size(0) && b[e].size(1) == rank && b[e].size(2) == out,
                "B: [capacity, rank, out]");
    TORCH_CHECK(col >= 0 && col + out <= y.size(1), "module columns outside y");
  }
}

}  // namespace

void lora_delta(at::Tensor y, const at::Tensor& x, const at::Tensor& runs, const at::Tensor& entries,
                const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  check_args(y, x, runs, entries, a, b);
  std::vector<Item> items = make_items(runs, entries, a, b, x.size(1));
  if (items.empty()) return;
  // biggest first: the threads' shared counter then ends with small items and balances the load
  std::stable_sort(items.begin(), items.end(), [](const Item& l, const Item& r) { return l.cost > r.cost; });
  const Rows m{x.data_ptr<float>(), x.stride(0), x.size(1), y.data_ptr<float>(), y.stride(0)};
  std::atomic<size_t> next{0};
  auto work = [&](int64_t, int64_t) {
    for (size_t i = next.fetch_add(1); i < items.size(); i = next.fetch_add(1)) run_item(items[i], m);
  };
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), items.size());
  if (workers <= 1) {
    work(0, 1);
  } else {
    at::parallel_for(0, workers, 1, work);
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lora_delta", &lora_delta, "y += segmented LoRA delta of x (float32, CPU)",
        py::call_guard<py::gil_scoped_release>());
}
"""
