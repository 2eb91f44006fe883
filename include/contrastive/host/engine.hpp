// Copyright (c) 2026 The contrastive authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// \file
/// Host execution of both algorithms, multi-threaded over row blocks.
///
/// Layout: Q and K are converted once per call to float, zero-padded to `dp` = dim rounded up to the micro-kernel's
/// NR, in two forms each: row-major (`qf`, `kf`: the B operand of dQ = G K and dK = G^T Q) and packed panels (`qp`,
/// `kp`: the operands of the logits tile Q K^T). A task owns `block_m` rows and walks the keys in tiles of `block_n`.
///
/// Work per symmetric forward+backward: fused 8 n_q n_k d flops (the backward recomputes the logits), materialized
/// 6 n_q n_k d. Memory: fused 2 (n_q + n_k) dp floats + per worker one n_k x dp dK accumulator; materialized adds the
/// n_q x n_k element-type matrix.

#include <contrastive/host/microkernel.hpp>
#include <contrastive/host/parallel.hpp>
#include <contrastive/numeric/element_traits.hpp>
#include <contrastive/numeric/loss_math.hpp>
#include <contrastive/numeric/math.hpp>
#include <contrastive/numeric/online_lse.hpp>
#include <contrastive/problem.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace contrastive
{
namespace host
{
inline constexpr std::size_t block_m = 64;  ///< rows per task (multiple of kernel_mr)
inline constexpr std::size_t block_n = 256; ///< columns per tile (multiple of kernel_nr and kernel_mr)

static_assert(block_m % kernel_mr == 0 && block_n % kernel_nr == 0 && block_n % kernel_mr == 0, "tile shapes");

inline std::size_t round_up(std::size_t x, std::size_t m) noexcept
{
  return (x + m - 1) / m * m;
}

/// Result of a forward pass.
struct forward_result
{
  float loss = 0.0f;
  float max_logit = 0.0f; ///< largest logit S_ij (materialized: its element-type value)
  bool logits_nonfinite = false;
};

/// Result of a backward pass. `grad_logit_scale` is d(loss_scale * loss)/d(log s).
struct backward_result
{
  float grad_logit_scale = 0.0f;
  bool dq_nonfinite = false;
  bool dk_nonfinite = false;
};

/// Sum of f(0..n) in 16 lanes (vectorisable: the compiler may not reorder a scalar float reduction).
template <class F>
CONTRASTIVE_FORCEINLINE float lane_sum(std::size_t n, F&& f) noexcept
{
  float acc[16] = {};
  std::size_t j = 0;
  for (; j + 16 <= n; j += 16)
  {
    for (int l = 0; l < 16; ++l)
    {
      acc[l] += f(j + l);
    }
  }
  float t = 0.0f;
  for (; j < n; ++j)
  {
    t += f(j);
  }
  for (int l = 0; l < 16; ++l)
  {
    t += acc[l];
  }
  return t;
}
template <class F>
CONTRASTIVE_FORCEINLINE float lane_max(std::size_t n, float init, F&& f) noexcept
{
  float acc[16];
  for (int l = 0; l < 16; ++l)
    acc[l] = init;
  std::size_t j = 0;
  for (; j + 16 <= n; j += 16)
  {
    for (int l = 0; l < 16; ++l)
    {
      const float x = f(j + l);
      acc[l] = acc[l] > x ? acc[l] : x;
    }
  }
  float t = init;
  for (; j < n; ++j)
  {
    const float x = f(j);
    t = t > x ? t : x;
  }
  for (int l = 0; l < 16; ++l)
  {
    t = t > acc[l] ? t : acc[l];
  }
  return t;
}

/// Reusable host state: converted operands, saved log-sum-exps and per-worker scratch. Not thread-safe; one engine
/// per concurrent caller.
template <class T>
class engine
{
  using traits = element_traits<T>;
  static constexpr std::size_t mr = kernel_mr;
  static constexpr std::size_t nr = kernel_nr;

public:
  explicit engine(unsigned threads = 0) : threads_(threads == 0 ? default_threads() : threads) {}

  unsigned threads() const noexcept
  {
    return threads_;
  }
  void set_threads(unsigned t) noexcept
  {
    threads_ = t == 0 ? default_threads() : t;
  }

  /// Converts and packs q and k. Returns the index (row * dim + col) + 1 of the first non-finite element of q
  /// (negative: of k), or 0 when all are finite. Nothing else is read or written.
  template <class Problem>
  std::ptrdiff_t prepare(const Problem& p)
  {
    n_q_ = p.n_q;
    n_k_ = p.n_k;
    d_ = p.dim;
    dp_ = round_up(d_, nr);
    nq_pad_ = round_up(n_q_, block_m);
    nk_pad_ = round_up(n_k_, block_n);
    obj_ = p.obj;
    labels_ = p.labels;
    qf_.assign(nq_pad_ * dp_, 0.0f);
    kf_.assign(nk_pad_ * dp_, 0.0f);
    qp_.resize(nq_pad_ * dp_);
    kp_.resize(nk_pad_ * dp_);
    const std::ptrdiff_t bad_q = convert(p.q, n_q_, qf_.data(), qp_.data(), nq_pad_, mr);
    if (bad_q != 0)
    {
      return bad_q;
    }
    const std::ptrdiff_t bad_k = convert(p.k, n_k_, kf_.data(), kp_.data(), nk_pad_, nr);
    return bad_k != 0 ? -bad_k : 0;
  }

  std::size_t positive_of(std::size_t i) const noexcept
  {
    return labels_ != nullptr ? static_cast<std::size_t>(labels_[i]) : i;
  }

  /// Forward with logits S = scale * Q K^T. Saves the row (and, symmetric, column) log-sum-exps for `backward`.
  template <class Algorithm>
  forward_result forward(float scale)
  {
    scale_ = scale;
    row_lse_.assign(n_q_, 0.0f);
    row_loss_.assign(n_q_, 0.0f);
    row_max_.assign(n_q_, 0.0f);
    pos_.assign(n_q_, 0.0f);
    const bool sym = obj_ == objective::symmetric;
    ensure_scratch(sym);
    const std::size_t tasks = nq_pad_ / block_m;
    if constexpr (std::is_same_v<Algorithm, algorithm::materialized>)
    {
      logits_.resize(n_q_ * n_k_);
      parallel_for(tasks,
                   threads_,
                   [&](std::size_t t, unsigned w)
                   {
                     materialize_block_row(t * block_m, w);
                   });
    }
    else
    {
      parallel_for(n_q_,
                   threads_,
                   [&](std::size_t i, unsigned)
                   {
                     pos_[i] = scale * dot(&qf_[i * dp_], &kf_[positive_of(i) * dp_]);
                   });
    }
    std::vector<unsigned char> bad(threads_, 0);
    parallel_for(tasks,
                 threads_,
                 [&](std::size_t t, unsigned w)
                 {
                   bad[w] |= forward_block_row<Algorithm>(t * block_m, w, sym) ? 1 : 0;
                 });
    forward_result r;
    for (unsigned char b : bad)
    {
      r.logits_nonfinite |= b != 0;
    }
    double row_sum = 0.0;
    float max_logit = -contrastive::detail::infinity_f;
    for (std::size_t i = 0; i < n_q_; ++i)
    {
      row_sum += row_loss_[i];
      r.logits_nonfinite |= !std::isfinite(pos_[i]);
      max_logit = std::max(max_logit, std::max(row_max_[i], pos_[i]));
    }
    r.max_logit = max_logit;
    double total = row_sum / static_cast<double>(n_q_);
    if (sym)
    {
      col_lse_.assign(n_k_, 0.0f);
      double col_sum = 0.0;
      for (std::size_t j = 0; j < n_k_; ++j)
      {
        online_lse c{};
        for (unsigned w = 0; w < threads_; ++w)
        {
          c.merge(online_lse{scratch_[w].col_max[j], scratch_[w].col_sum[j]});
        }
        const row_loss rl = finish_row(c, pos_[j]);
        col_lse_[j] = rl.lse;
        col_sum += rl.loss;
      }
      total = 0.5 * (total + col_sum / static_cast<double>(n_k_));
    }
    r.loss = static_cast<float>(total);
    return r;
  }

  /// Backward of `loss_scale * loss` after `forward`. Writes dq (n_q x dim) and dk (n_k x dim) in T.
  template <class Algorithm>
  backward_result backward(float loss_scale, T* dq, T* dk)
  {
    const bool sym = obj_ == objective::symmetric;
    const grad_coefficients gc = make_grad_coefficients(obj_, n_q_, n_k_);
    const std::size_t row_tasks = nq_pad_ / block_m;
    std::vector<double> dlogs(threads_, 0.0);
    std::vector<unsigned char> bad_q(threads_, 0), bad_k(threads_, 0);
    backward_result r;
    if constexpr (std::is_same_v<Algorithm, algorithm::materialized>)
    {
      parallel_for(row_tasks,
                   threads_,
                   [&](std::size_t t, unsigned w)
                   {
                     dlogs[w] += materialized_grad_block_row(t * block_m, w, loss_scale, gc, sym);
                   });
      parallel_for(row_tasks,
                   threads_,
                   [&](std::size_t t, unsigned w)
                   {
                     bad_q[w] |= materialized_dq_block(t * block_m, w, dq) ? 1 : 0;
                   });
      parallel_for(nk_pad_ / block_n,
                   threads_,
                   [&](std::size_t t, unsigned w)
                   {
                     bad_k[w] |= materialized_dk_block(t * block_n, w, dk) ? 1 : 0;
                   });
      double total = 0.0;
      for (double v : dlogs)
      {
        total += v;
      }
      r.grad_logit_scale = static_cast<float>(static_cast<double>(scale_) * total);
    }
    else
    {
      for (unsigned w = 0; w < threads_; ++w)
      {
        scratch_[w].dk_acc.assign(nk_pad_ * dp_, 0.0f);
      }
      const float out_scale = loss_scale * scale_;
      parallel_for(row_tasks,
                   threads_,
                   [&](std::size_t t, unsigned w)
                   {
                     dlogs[w] += fused_backward_block_row(t * block_m, w, gc, sym, out_scale, dq, bad_q[w]);
                   });
      // dK = sum over workers of their accumulators, scaled and rounded once.
      const std::size_t chunk = 64;
      parallel_for((n_k_ + chunk - 1) / chunk,
                   threads_,
                   [&](std::size_t t, unsigned w)
                   {
                     const std::size_t j_end = std::min(n_k_, (t + 1) * chunk);
                     bool bad = false;
                     for (std::size_t j = t * chunk; j < j_end; ++j)
                     {
                       float* acc0 = &scratch_[0].dk_acc[j * dp_];
                       for (unsigned u = 1; u < threads_; ++u)
                       {
                         const float* accu = &scratch_[u].dk_acc[j * dp_];
                         for (std::size_t c = 0; c < d_; ++c)
                         {
                           acc0[c] += accu[c];
                         }
                       }
                       bad |= store_row(acc0, out_scale, dk + j * d_);
                     }
                     bad_k[w] |= bad ? 1 : 0;
                   });
      double total = 0.0;
      for (double v : dlogs)
      {
        total += v;
      }
      r.grad_logit_scale = static_cast<float>(static_cast<double>(out_scale) * total);
    }
    for (unsigned w = 0; w < threads_; ++w)
    {
      r.dq_nonfinite |= bad_q[w] != 0;
      r.dk_nonfinite |= bad_k[w] != 0;
    }
    return r;
  }

  const std::vector<float>& row_lse() const noexcept
  {
    return row_lse_;
  }
  const std::vector<float>& col_lse() const noexcept
  {
    return col_lse_;
  }

  /// Bytes held by the engine's buffers (operands, saved statistics, scratch, the materialized matrix).
  std::size_t bytes_held() const noexcept
  {
    std::size_t b =
        (qf_.capacity() + kf_.capacity() + qp_.capacity() + kp_.capacity()) * sizeof(float) +
        (row_lse_.capacity() + row_loss_.capacity() + pos_.capacity() + col_lse_.capacity()) * sizeof(float) +
        logits_.capacity() * sizeof(T);
    for (const auto& s : scratch_)
    {
      b += (s.tile.capacity() + s.gq.capacity() + s.gk.capacity() + s.acc.capacity() + s.col_max.capacity() +
            s.col_sum.capacity() + s.dk_acc.capacity()) *
           sizeof(float);
    }
    return b;
  }

  /// Frees every buffer.
  void release()
  {
    *this = engine(threads_);
  }

private:
  struct worker_scratch
  {
    std::vector<float> tile;    // block_m x block_n logits
    std::vector<float> gq;      // packed G for dQ: [block_m / mr][block_n][mr]
    std::vector<float> gk;      // packed G^T for dK: [block_n / mr][block_m][mr]
    std::vector<float> acc;     // block_m x dp (dQ) or block_n x dp (materialized dK)
    std::vector<float> col_max; // n_k column running max (symmetric forward)
    std::vector<float> col_sum; // n_k column running sum
    std::vector<float> dk_acc;  // n_k_pad x dp (fused backward)
  };

  std::ptrdiff_t
  convert(const T* src, std::size_t rows, float* rowmajor, float* packed, std::size_t rows_pad, std::size_t panel)
  {
    std::vector<std::ptrdiff_t> first_bad(threads_, 0);
    const std::size_t chunk = 256;
    const std::size_t d = d_;
    const std::size_t dp = dp_;
    parallel_for((rows + chunk - 1) / chunk,
                 threads_,
                 [&](std::size_t t, unsigned w)
                 {
                   const std::size_t end = std::min(rows, (t + 1) * chunk);
                   for (std::size_t i = t * chunk; i < end; ++i)
                   {
                     const T* s = src + i * d;
                     float* out = rowmajor + i * dp;
                     bool finite = true;
                     for (std::size_t c = 0; c < d; ++c)
                     {
                       const float x = traits::to_float(s[c]);
                       out[c] = x;
                       finite &= x - x == 0.0f;
                     }
                     if (!finite)
                     {
                       for (std::size_t c = 0; c < d; ++c)
                       {
                         if (!traits::is_finite(s[c]))
                         {
                           const std::ptrdiff_t idx = static_cast<std::ptrdiff_t>(i * d + c) + 1;
                           if (first_bad[w] == 0 || idx < first_bad[w])
                           {
                             first_bad[w] = idx;
                           }
                           break;
                         }
                       }
                     }
                   }
                 });
    std::ptrdiff_t bad = 0;
    for (std::ptrdiff_t b : first_bad)
    {
      if (b != 0 && (bad == 0 || b < bad))
      {
        bad = b;
      }
    }
    if (bad != 0)
    {
      return bad;
    }
    // Packed panels: panel r holds rows [r*panel, (r+1)*panel) as [dp][panel].
    parallel_for(rows_pad / panel,
                 threads_,
                 [&](std::size_t r, unsigned)
                 {
                   float* dst = packed + r * dp * panel;
                   const float* base = rowmajor + r * panel * dp;
                   for (std::size_t c = 0; c < dp; ++c)
                   {
                     for (std::size_t ii = 0; ii < panel; ++ii)
                     {
                       dst[c * panel + ii] = base[ii * dp + c];
                     }
                   }
                 });
    return 0;
  }

  static float dot(const float* a, const float* b, std::size_t n) noexcept
  {
    float s[16] = {};
    std::size_t c = 0;
    for (; c + 16 <= n; c += 16)
    {
      for (int l = 0; l < 16; ++l)
      {
        s[l] += a[c + l] * b[c + l];
      }
    }
    float t = 0.0f;
    for (; c < n; ++c)
    {
      t += a[c] * b[c];
    }
    for (int l = 0; l < 16; ++l)
    {
      t += s[l];
    }
    return t;
  }
  float dot(const float* a, const float* b) const noexcept
  {
    return dot(a, b, dp_);
  }

  void ensure_scratch(bool sym)
  {
    scratch_.resize(threads_);
    for (auto& s : scratch_)
    {
      s.tile.resize(block_m * block_n);
      s.gq.resize(block_m * block_n);
      s.gk.resize(block_m * block_n);
      if (sym)
      {
        s.col_max.assign(nk_pad_, -contrastive::detail::infinity_f);
        s.col_sum.assign(nk_pad_, 0.0f);
      }
    }
  }

  /// Unscaled dot products of rows [i0, i0 + block_m) with keys [j0, j0 + block_n) into `tile` (ld block_n).
  void logits_tile(std::size_t i0, std::size_t j0, float* tile) const noexcept
  {
    const std::size_t rows = std::min(block_m, n_q_ - i0);
    const std::size_t cols = std::min(block_n, n_k_ - j0);
    for (std::size_t c = 0; c * nr < cols; ++c)
    {
      const float* b = &kp_[(j0 / nr + c) * dp_ * nr];
      for (std::size_t r = 0; r * mr < rows; ++r)
      {
        const float* a = &qp_[(i0 / mr + r) * dp_ * mr];
        kernel::micro_kernel(dp_, a, mr, b, nr, tile + r * mr * block_n + c * nr, block_n, false);
      }
    }
  }

  void materialize_block_row(std::size_t i0, unsigned w)
  {
    std::vector<float>& tile = scratch_[w].tile;
    const std::size_t rows = std::min(block_m, n_q_ - i0);
    for (std::size_t j0 = 0; j0 < n_k_; j0 += block_n)
    {
      const std::size_t cols = std::min(block_n, n_k_ - j0);
      logits_tile(i0, j0, tile.data());
      for (std::size_t ii = 0; ii < rows; ++ii)
      {
        T* out = &logits_[(i0 + ii) * n_k_ + j0];
        const float* in = &tile[ii * block_n];
        for (std::size_t jj = 0; jj < cols; ++jj)
        {
          out[jj] = traits::from_float(in[jj]);
        }
      }
    }
  }

  /// Loads the scaled logits of block (i0, j0) into `tile`; returns whether any is non-finite.
  template <class Algorithm>
  bool load_scaled_logits(std::size_t i0, std::size_t j0, float* tile, std::size_t rows, std::size_t cols)
  {
    const float s = scale_;
    float poison = 0.0f;
    if constexpr (std::is_same_v<Algorithm, algorithm::materialized>)
    {
      for (std::size_t ii = 0; ii < rows; ++ii)
      {
        const T* in = &logits_[(i0 + ii) * n_k_ + j0];
        float* out = &tile[ii * block_n];
        poison += lane_sum(cols,
                           [&](std::size_t jj)
                           {
                             const float x = round_to<T>(s * traits::to_float(in[jj]));
                             out[jj] = x;
                             return x * 0.0f;
                           });
      }
    }
    else
    {
      logits_tile(i0, j0, tile);
      for (std::size_t ii = 0; ii < rows; ++ii)
      {
        float* row = &tile[ii * block_n];
        poison += lane_sum(cols,
                           [&](std::size_t jj)
                           {
                             const float x = s * row[jj];
                             row[jj] = x;
                             return x * 0.0f;
                           });
      }
    }
    return poison != 0.0f;
  }

  template <class Algorithm>
  bool forward_block_row(std::size_t i0, unsigned w, bool sym)
  {
    worker_scratch& ws = scratch_[w];
    float* tile = ws.tile.data();
    const std::size_t rows = std::min(block_m, n_q_ - i0);
    online_lse row_state[block_m];
    bool bad = false;
    for (std::size_t j0 = 0; j0 < n_k_; j0 += block_n)
    {
      const std::size_t cols = std::min(block_n, n_k_ - j0);
      bad |= load_scaled_logits<Algorithm>(i0, j0, tile, rows, cols);
      // Exclude each positive from the negatives' statistics (row and, symmetric, column: the same element).
      for (std::size_t ii = 0; ii < rows; ++ii)
      {
        const std::size_t p = positive_of(i0 + ii);
        if (p >= j0 && p < j0 + cols)
        {
          float& x = tile[ii * block_n + (p - j0)];
          if constexpr (std::is_same_v<Algorithm, algorithm::materialized>)
          {
            pos_[i0 + ii] = x;
          }
          x = -contrastive::detail::infinity_f;
        }
      }
      for (std::size_t ii = 0; ii < rows; ++ii)
      {
        const float* x = &tile[ii * block_n];
        const float m = lane_max(cols,
                                 -contrastive::detail::infinity_f,
                                 [&](std::size_t jj)
                                 {
                                   return x[jj];
                                 });
        if (m == -contrastive::detail::infinity_f)
        {
          continue;
        }
        online_lse& st = row_state[ii];
        const float new_max = contrastive::detail::max_f(st.max, m);
        const float sum = lane_sum(cols,
                                   [&](std::size_t jj)
                                   {
                                     return contrastive::detail::exp_approx(x[jj] - new_max);
                                   });
        st.sum = st.sum * contrastive::detail::exp_approx(st.max - new_max) + sum;
        st.max = new_max;
      }
      if (sym)
      {
        float* cmax = &ws.col_max[j0];
        float* csum = &ws.col_sum[j0];
        float new_max[block_n];
        float shift[block_n];
        for (std::size_t jj = 0; jj < cols; ++jj)
        {
          new_max[jj] = cmax[jj];
        }
        for (std::size_t ii = 0; ii < rows; ++ii)
        {
          const float* x = &tile[ii * block_n];
          for (std::size_t jj = 0; jj < cols; ++jj)
          {
            new_max[jj] = contrastive::detail::max_f(new_max[jj], x[jj]);
          }
        }
        for (std::size_t jj = 0; jj < cols; ++jj)
        {
          const bool empty = new_max[jj] == -contrastive::detail::infinity_f;
          shift[jj] = empty ? 0.0f : new_max[jj];
          csum[jj] = empty ? 0.0f : csum[jj] * contrastive::detail::exp_approx(cmax[jj] - shift[jj]);
          cmax[jj] = new_max[jj];
        }
        for (std::size_t ii = 0; ii < rows; ++ii)
        {
          const float* x = &tile[ii * block_n];
          for (std::size_t jj = 0; jj < cols; ++jj)
          {
            csum[jj] += contrastive::detail::exp_approx(x[jj] - shift[jj]);
          }
        }
      }
    }
    for (std::size_t ii = 0; ii < rows; ++ii)
    {
      const row_loss rl = finish_row(row_state[ii], pos_[i0 + ii]);
      row_lse_[i0 + ii] = rl.lse;
      row_loss_[i0 + ii] = rl.loss;
      row_max_[i0 + ii] = row_state[ii].max;
    }
    return bad;
  }

  /// G = dL/dS for the block into `tile` (rows x cols valid; the rest zero), from scaled logits already in `tile`.
  void gradient_block(std::size_t i0,
                      std::size_t j0,
                      float* tile,
                      std::size_t rows,
                      std::size_t cols,
                      const grad_coefficients& gc,
                      bool sym) const noexcept
  {
    for (std::size_t ii = 0; ii < block_m; ++ii)
    {
      float* g = &tile[ii * block_n];
      if (ii >= rows)
      {
        std::fill(g, g + block_n, 0.0f);
        continue;
      }
      const float lr = row_lse_[i0 + ii];
      if (sym)
      {
        const float* lc = &col_lse_[j0];
        for (std::size_t jj = 0; jj < cols; ++jj)
        {
          g[jj] = gc.row_coef * contrastive::detail::exp_approx(g[jj] - lr) +
                  gc.col_coef * contrastive::detail::exp_approx(g[jj] - lc[jj]);
        }
      }
      else
      {
        for (std::size_t jj = 0; jj < cols; ++jj)
        {
          g[jj] = gc.row_coef * contrastive::detail::exp_approx(g[jj] - lr);
        }
      }
      std::fill(g + cols, g + block_n, 0.0f);
      const std::size_t p = positive_of(i0 + ii);
      if (p >= j0 && p < j0 + cols)
      {
        g[p - j0] -= gc.pos_coef;
      }
    }
  }

  /// Packs G (block_m x block_n, ld block_n) as the A operand of dQ += G K: [block_m / mr][kc][mr].
  static void pack_for_dq(const float* g, float* out, std::size_t kc) noexcept
  {
    for (std::size_t r = 0; r < block_m / mr; ++r)
    {
      float* dst = out + r * block_n * mr;
      for (std::size_t jj = 0; jj < kc; ++jj)
      {
        for (std::size_t ii = 0; ii < mr; ++ii)
        {
          dst[jj * mr + ii] = g[(r * mr + ii) * block_n + jj];
        }
      }
    }
  }

  /// Packs G^T as the A operand of dK += G^T Q: [block_n / mr][block_m][mr].
  static void pack_for_dk(const float* g, float* out, std::size_t cols) noexcept
  {
    for (std::size_t c = 0; c * mr < cols; ++c)
    {
      float* dst = out + c * block_m * mr;
      for (std::size_t ii = 0; ii < block_m; ++ii)
      {
        const float* src = g + ii * block_n + c * mr;
        for (std::size_t jj = 0; jj < mr; ++jj)
        {
          dst[ii * mr + jj] = src[jj];
        }
      }
    }
  }

  /// C (block of rows, ld dp) += packed A [panels][kc][mr] times B (kc rows of ld dp).
  void gemm_panels(const float* a,
                   std::size_t panels,
                   std::size_t a_panel_stride,
                   std::size_t kc,
                   const float* b,
                   float* c) const noexcept
  {
    for (std::size_t r = 0; r < panels; ++r)
    {
      for (std::size_t d0 = 0; d0 < dp_; d0 += nr)
      {
        kernel::micro_kernel(kc, a + r * a_panel_stride, mr, b + d0, dp_, c + r * mr * dp_ + d0, dp_, true);
      }
    }
  }

  /// Scales a float row by `factor`, rounds to T, writes `d_` elements; returns whether any result is non-finite.
  bool store_row(const float* acc, float factor, T* out) const noexcept
  {
    float poison = 0.0f;
    for (std::size_t c = 0; c < d_; ++c)
    {
      const T v = traits::from_float(factor * acc[c]);
      poison += traits::to_float(v) * 0.0f;
      out[c] = v;
    }
    return poison != 0.0f;
  }

  double fused_backward_block_row(
      std::size_t i0, unsigned w, const grad_coefficients& gc, bool sym, float out_scale, T* dq, unsigned char& bad_q)
  {
    worker_scratch& ws = scratch_[w];
    float* tile = ws.tile.data();
    ws.acc.assign(block_m * dp_, 0.0f);
    const std::size_t rows = std::min(block_m, n_q_ - i0);
    const std::size_t row_panels = (rows + mr - 1) / mr;
    for (std::size_t j0 = 0; j0 < n_k_; j0 += block_n)
    {
      const std::size_t cols = std::min(block_n, n_k_ - j0);
      load_scaled_logits<algorithm::fused>(i0, j0, tile, rows, cols);
      gradient_block(i0, j0, tile, rows, cols, gc, sym);
      pack_for_dq(tile, ws.gq.data(), cols);
      gemm_panels(ws.gq.data(), row_panels, block_n * mr, cols, &kf_[j0 * dp_], ws.acc.data());
      pack_for_dk(tile, ws.gk.data(), cols);
      gemm_panels(ws.gk.data(), (cols + mr - 1) / mr, block_m * mr, rows, &qf_[i0 * dp_], &ws.dk_acc[j0 * dp_]);
    }
    double dlogs = 0.0;
    bool bad = false;
    for (std::size_t ii = 0; ii < rows; ++ii)
    {
      const float* acc = &ws.acc[ii * dp_];
      dlogs += static_cast<double>(dot(acc, &qf_[(i0 + ii) * dp_]));
      bad |= store_row(acc, out_scale, dq + (i0 + ii) * d_);
    }
    bad_q |= bad ? 1 : 0;
    return dlogs;
  }

  /// Elementwise backward over the stored logits: M <- dA = round_T(s round_T(loss_scale G)); returns sum dS * A.
  double
  materialized_grad_block_row(std::size_t i0, unsigned w, float loss_scale, const grad_coefficients& gc, bool sym)
  {
    std::vector<float>& tile = scratch_[w].tile;
    const std::size_t rows = std::min(block_m, n_q_ - i0);
    double dlogs = 0.0;
    for (std::size_t j0 = 0; j0 < n_k_; j0 += block_n)
    {
      const std::size_t cols = std::min(block_n, n_k_ - j0);
      load_scaled_logits<algorithm::materialized>(i0, j0, tile.data(), rows, cols);
      gradient_block(i0, j0, tile.data(), rows, cols, gc, sym);
      for (std::size_t ii = 0; ii < rows; ++ii)
      {
        T* m = &logits_[(i0 + ii) * n_k_ + j0];
        const float* g = &tile[ii * block_n];
        const float part = lane_sum(cols,
                                    [&](std::size_t jj)
                                    {
                                      const float ds = round_to<T>(loss_scale * g[jj]);
                                      const float prod = ds * traits::to_float(m[jj]);
                                      m[jj] = traits::from_float(scale_ * ds);
                                      return prod;
                                    });
        dlogs += part;
      }
    }
    return dlogs;
  }

  bool materialized_dq_block(std::size_t i0, unsigned w, T* dq)
  {
    worker_scratch& ws = scratch_[w];
    ws.acc.assign(block_m * dp_, 0.0f);
    const std::size_t rows = std::min(block_m, n_q_ - i0);
    float* tile = ws.tile.data();
    for (std::size_t j0 = 0; j0 < n_k_; j0 += block_n)
    {
      const std::size_t cols = std::min(block_n, n_k_ - j0);
      for (std::size_t ii = 0; ii < block_m; ++ii)
      {
        float* t = &tile[ii * block_n];
        if (ii < rows)
        {
          const T* m = &logits_[(i0 + ii) * n_k_ + j0];
          for (std::size_t jj = 0; jj < cols; ++jj)
          {
            t[jj] = traits::to_float(m[jj]);
          }
        }
        else
        {
          std::fill(t, t + cols, 0.0f);
        }
      }
      pack_for_dq(tile, ws.gq.data(), cols);
      gemm_panels(ws.gq.data(), (rows + mr - 1) / mr, block_n * mr, cols, &kf_[j0 * dp_], ws.acc.data());
    }
    bool bad = false;
    for (std::size_t ii = 0; ii < rows; ++ii)
    {
      bad |= store_row(&ws.acc[ii * dp_], 1.0f, dq + (i0 + ii) * d_);
    }
    return bad;
  }

  bool materialized_dk_block(std::size_t j0, unsigned w, T* dk)
  {
    worker_scratch& ws = scratch_[w];
    ws.acc.assign(block_n * dp_, 0.0f);
    if (j0 >= n_k_)
    {
      return false;
    }
    const std::size_t cols = std::min(block_n, n_k_ - j0);
    float* tile = ws.tile.data();
    for (std::size_t i0 = 0; i0 < n_q_; i0 += block_m)
    {
      const std::size_t rows = std::min(block_m, n_q_ - i0);
      for (std::size_t ii = 0; ii < block_m; ++ii)
      {
        float* t = &tile[ii * block_n];
        if (ii < rows)
        {
          const T* m = &logits_[(i0 + ii) * n_k_ + j0];
          for (std::size_t jj = 0; jj < cols; ++jj)
          {
            t[jj] = traits::to_float(m[jj]);
          }
          std::fill(t + cols, t + round_up(cols, mr), 0.0f);
        }
        else
        {
          std::fill(t, t + round_up(cols, mr), 0.0f);
        }
      }
      pack_for_dk(tile, ws.gk.data(), cols);
      gemm_panels(ws.gk.data(), (cols + mr - 1) / mr, block_m * mr, rows, &qf_[i0 * dp_], ws.acc.data());
    }
    bool bad = false;
    for (std::size_t jj = 0; jj < cols; ++jj)
    {
      bad |= store_row(&ws.acc[jj * dp_], 1.0f, dk + (j0 + jj) * d_);
    }
    return bad;
  }

  unsigned threads_;
  std::size_t n_q_ = 0, n_k_ = 0, d_ = 0, dp_ = 0, nq_pad_ = 0, nk_pad_ = 0;
  objective obj_ = objective::symmetric;
  const std::int32_t* labels_ = nullptr;
  float scale_ = 1.0f;
  std::vector<float> qf_, kf_, qp_, kp_;
  std::vector<float> row_lse_, row_loss_, row_max_, pos_, col_lse_;
  std::vector<T> logits_;
  std::vector<worker_scratch> scratch_;
};
} // namespace host
} // namespace contrastive
