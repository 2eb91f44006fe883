// Element traits, the vectorisable exp, and the online log-sum-exp.

#include "test_util.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>

using contrastive::element_traits;

namespace
{
std::uint32_t bits_of(float x)
{
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
float float_of(std::uint32_t u)
{
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}
} // namespace

// Every half converts exactly as the CUDA Toolkit's own conversion does.
TEST(ElementTraits, HalfToFloatExhaustiveAgainstCudaToolkit)
{
  for (std::uint32_t b = 0; b < 65536; ++b)
  {
    const __half h = element_traits<__half>::from_bits(static_cast<std::uint16_t>(b));
    const float mine = element_traits<__half>::to_float(h);
    const float cuda = __half2float(h);
    if (std::isnan(cuda))
    {
      ASSERT_TRUE(std::isnan(mine)) << b;
    }
    else
    {
      ASSERT_EQ(bits_of(mine), bits_of(cuda)) << "half bits " << b;
    }
  }
}

// float -> half/bf16 round to nearest even, bit for bit with cuda_fp16.h / cuda_bf16.h, over random floats of every
// exponent and over the boundaries (largest finite, overflow threshold, subnormals, ties).
TEST(ElementTraits, FloatToHalfAndBf16MatchCudaRounding)
{
  std::mt19937 rng(7);
  std::uniform_int_distribution<std::uint32_t> any;
  std::vector<float> cases = {0.0f,
                              -0.0f,
                              65504.0f,
                              65519.996f,
                              65520.0f,
                              -65520.0f,
                              6.1035156e-05f,
                              5.9604645e-08f,
                              2.9802322e-08f,
                              2.9802326e-08f,
                              1.0f + 1.0f / 2048.0f,
                              1.0f + 3.0f / 2048.0f,
                              INFINITY,
                              -INFINITY,
                              3.3895314e38f,
                              3.4028235e38f};
  for (int i = 0; i < 400000; ++i)
  {
    cases.push_back(float_of(any(rng)));
  }
  for (float f : cases)
  {
    if (std::isnan(f))
    {
      EXPECT_TRUE(std::isnan(element_traits<__half>::to_float(element_traits<__half>::from_float(f))));
      EXPECT_TRUE(std::isnan(element_traits<__nv_bfloat16>::to_float(element_traits<__nv_bfloat16>::from_float(f))));
      continue;
    }
    ASSERT_EQ(element_traits<__half>::bits(element_traits<__half>::from_float(f)),
              element_traits<__half>::bits(__float2half_rn(f)))
        << f;
    ASSERT_EQ(element_traits<__nv_bfloat16>::bits(element_traits<__nv_bfloat16>::from_float(f)),
              element_traits<__nv_bfloat16>::bits(__float2bfloat16_rn(f)))
        << f;
  }
}

TEST(ElementTraits, RangeConstantsAndFiniteness)
{
  EXPECT_EQ(element_traits<__half>::max_finite(), 65504.0f);
  EXPECT_EQ(element_traits<__half>::to_float(element_traits<__half>::from_float(65504.0f)), 65504.0f);
  EXPECT_TRUE(std::isinf(contrastive::round_to<__half>(65520.0f)));
  EXPECT_EQ(element_traits<__half>::min_normal(), std::ldexp(1.0f, -14));
  EXPECT_EQ(element_traits<__half>::epsilon(), std::ldexp(1.0f, -10));
  EXPECT_EQ(element_traits<__nv_bfloat16>::epsilon(), std::ldexp(1.0f, -7));
  EXPECT_EQ(element_traits<__nv_bfloat16>::min_normal(), std::numeric_limits<float>::min());
  EXPECT_EQ(contrastive::round_to<__nv_bfloat16>(element_traits<__nv_bfloat16>::max_finite()),
            element_traits<__nv_bfloat16>::max_finite());
  EXPECT_EQ(element_traits<float>::max_finite(), std::numeric_limits<float>::max());
  EXPECT_EQ(element_traits<float>::epsilon(), std::numeric_limits<float>::epsilon());
  EXPECT_TRUE(element_traits<__half>::is_finite(element_traits<__half>::from_float(65504.0f)));
  EXPECT_FALSE(element_traits<__half>::is_finite(element_traits<__half>::from_float(1e6f)));
  EXPECT_FALSE(element_traits<__half>::is_finite(element_traits<__half>::from_float(NAN)));
  EXPECT_FALSE(element_traits<__nv_bfloat16>::is_finite(element_traits<__nv_bfloat16>::from_float(INFINITY)));
  EXPECT_TRUE(element_traits<__nv_bfloat16>::is_finite(element_traits<__nv_bfloat16>::from_float(1e38f)));
  EXPECT_FALSE(element_traits<float>::is_finite(NAN));
  EXPECT_TRUE(element_traits<float>::is_finite(3e38f));
}

// exp_approx is within 2 ulp of the correctly rounded exp over the whole range where the result is a normal float,
// and handles the edges.
TEST(ExpApprox, WithinTwoUlpOverTheRange)
{
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> x_dist(-87.0f, 88.7f);
  double worst = 0.0;
  for (int i = 0; i < 2000000; ++i)
  {
    const float x = i < 1000 ? -1.0f + i * 0.002f : x_dist(rng);
    const double want = std::exp(static_cast<double>(x));
    const float got = contrastive::detail::exp_approx(x);
    const double ulp = std::ldexp(1.0, std::ilogb(static_cast<float>(want)) - 23);
    worst = std::max(worst, std::fabs(got - want) / ulp);
  }
  EXPECT_LE(worst, 2.0);
  EXPECT_EQ(contrastive::detail::exp_approx(0.0f), 1.0f);
  EXPECT_EQ(contrastive::detail::exp_approx(-INFINITY), 0.0f);
  EXPECT_EQ(contrastive::detail::exp_approx(-200.0f), 0.0f);
  EXPECT_TRUE(std::isinf(contrastive::detail::exp_approx(89.0f)));
  EXPECT_TRUE(std::isinf(contrastive::detail::exp_approx(INFINITY)));
  EXPECT_TRUE(std::isnan(contrastive::detail::exp_approx(NAN)));
  // Subnormal results keep their relative accuracy to within an ulp of the subnormal grid.
  const float sub = contrastive::detail::exp_approx(-95.0f);
  EXPECT_NEAR(sub, std::exp(-95.0), std::ldexp(1.0, -149));
}

TEST(OnlineLse, MergeIsOrderIndependentAndMatchesDirectSum)
{
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> d(-30.0f, 30.0f);
  std::vector<float> xs(1000);
  for (auto& x : xs)
  {
    x = d(rng);
  }
  contrastive::online_lse all, a, b;
  for (std::size_t i = 0; i < xs.size(); ++i)
  {
    all.push(xs[i]);
    (i % 3 == 0 ? a : b).push(xs[i]);
  }
  contrastive::online_lse ab = a, ba = b;
  ab.merge(b);
  ba.merge(a);
  double m = -INFINITY, s = 0.0;
  for (float x : xs)
  {
    m = std::max(m, double(x));
  }
  for (float x : xs)
  {
    s += std::exp(x - m);
  }
  const double want = m + std::log(s);
  EXPECT_NEAR(all.value(), want, 4e-6 * std::fabs(want));
  EXPECT_NEAR(ab.value(), want, 4e-6 * std::fabs(want));
  EXPECT_NEAR(ba.value(), want, 4e-6 * std::fabs(want));
  contrastive::online_lse empty;
  EXPECT_EQ(empty.value(), -INFINITY);
  ab.merge(empty);
  EXPECT_NEAR(ab.value(), want, 4e-6 * std::fabs(want));
}

TEST(OnlineLse, OverflowedInputPoisonsTheResult)
{
  contrastive::online_lse st;
  st.push(1.0f);
  st.push(INFINITY);
  st.push(2.0f);
  const contrastive::row_loss r = contrastive::finish_row(st, 0.5f);
  EXPECT_FALSE(std::isfinite(r.loss));
  contrastive::online_lse n;
  n.push(NAN);
  EXPECT_TRUE(std::isnan(contrastive::finish_row(n, 1.0f).loss));
}

// absorb (one exponential per value, the chunked algorithm's update) agrees with push/merge, skips -inf, keeps an
// empty state empty, and is poisoned by +inf and NaN as push is.
TEST(OnlineLse, AbsorbMatchesPush)
{
  std::mt19937 rng(12);
  std::uniform_real_distribution<float> d(-40.0f, 40.0f);
  contrastive::online_lse pushed, absorbed;
  for (int i = 0; i < 5000; ++i)
  {
    const float x = i % 97 == 0 ? -INFINITY : d(rng);
    if (x != -INFINITY)
    {
      pushed.push(x);
    }
    absorbed.absorb(x);
  }
  EXPECT_EQ(absorbed.max, pushed.max);
  EXPECT_NEAR(absorbed.value(), pushed.value(), 2e-6 * std::fabs(pushed.value()));
  contrastive::online_lse empty;
  empty.absorb(-INFINITY);
  EXPECT_EQ(empty.max, -INFINITY);
  EXPECT_EQ(empty.sum, 0.0f);
  contrastive::online_lse inf;
  inf.absorb(1.0f);
  inf.absorb(INFINITY);
  inf.absorb(2.0f);
  EXPECT_FALSE(std::isfinite(contrastive::finish_row(inf, 0.5f).loss));
  contrastive::online_lse nan;
  nan.absorb(1.0f);
  nan.absorb(NAN);
  nan.absorb(3.0f);
  EXPECT_TRUE(std::isnan(contrastive::finish_row(nan, 1.0f).loss));
}

// The host micro-kernel is the one the build asked for (CMake's CONTRASTIVE_HOST_ISA), so an ISA matrix in CI really
// runs each kernel; and the block shapes the tests derive their expectations from are consistent with it.
TEST(HostIsa, KernelIsTheConfiguredOne)
{
  namespace h = contrastive::host;
  const std::string isa = CONTRASTIVE_TEST_HOST_ISA;
  std::printf("host kernel: %s, bfloat16 dot products: %s (%s), MR x NR = %d x %d, block_m %zu, block_n %zu "
              "(CONTRASTIVE_HOST_ISA=%s)\n",
              h::kernel_isa,
              h::bf16_kernel(),
              h::amx::describe(h::amx::status()),
              h::kernel_mr,
              h::kernel_nr,
              h::block_m,
              h::block_n,
              isa.c_str());
  if (isa == "avx512bf16")
  {
    EXPECT_STREQ(h::kernel_isa, "avx512");
    EXPECT_TRUE(h::bf16_dot);
  }
  else if (isa == "avx512")
  {
    EXPECT_STREQ(h::kernel_isa, "avx512");
    EXPECT_FALSE(h::bf16_dot);
  }
  else if (isa == "avx2")
  {
    EXPECT_STREQ(h::kernel_isa, "avx2+fma");
  }
  else if (isa == "portable")
  {
    EXPECT_STREQ(h::kernel_isa, "generic");
  }
  if (isa == "avx2" || isa == "portable")
  {
    EXPECT_FALSE(h::bf16_dot);
  }
  EXPECT_EQ(h::block_m % h::kernel_mr, 0u);
  EXPECT_EQ(h::block_n % h::kernel_nr, 0u);
  EXPECT_EQ(h::block_n % h::kernel_mr, 0u);
  EXPECT_EQ(h::kernel_nr % h::vector_floats, 0);
}

// The host's vectorised half stores (F16C vcvtps2ph, round to nearest even) give the scalar conversion's bits for every
// non-NaN float: all exponents and signs, mantissas around every rounding boundary, and random bit patterns.
TEST(ElementTraits, VectorHalfStoresMatchTheScalarConversion)
{
#if !defined(__F16C__)
  GTEST_SKIP() << "this build does not target F16C: every half store is the scalar conversion";
#else
  using traits = element_traits<__half>;
  std::vector<float> in;
  for (std::uint32_t e = 0; e < 256; ++e)
  {
    for (std::uint32_t m : {0u, 1u, 0xfffu, 0x1000u, 0x1001u, 0x1fffu, 0x2000u, 0x3fffffu, 0x400000u, 0x7fffffu})
    {
      for (std::uint32_t sign : {0u, 0x80000000u})
      {
        const float x = float_of(sign | e << 23 | m);
        if (!std::isnan(x))
        {
          in.push_back(x);
        }
      }
    }
  }
  std::mt19937 rng(77);
  while (in.size() % 8 != 0 || in.size() < (1u << 20))
  {
    const float x = float_of(static_cast<std::uint32_t>(rng()));
    if (!std::isnan(x))
    {
      in.push_back(x);
    }
  }
  std::vector<__half> vec(in.size());
  const bool poisoned = contrastive::host::store_scaled_row(in.data(), 1.0f, vec.data(), in.size());
  EXPECT_TRUE(poisoned) << "infinities (and overflows to them) are in the input";
  for (std::size_t i = 0; i < in.size(); ++i)
  {
    ASSERT_EQ(traits::bits(vec[i]), traits::bits(traits::from_float(in[i]))) << "x = " << in[i];
  }
  // A finite row that stays finite is not poisoned; a NaN anywhere is, and keeps the scalar NaN bits.
  std::vector<float> row(37, 0.25f);
  std::vector<__half> out(row.size());
  EXPECT_FALSE(contrastive::host::store_scaled_row(row.data(), 2.0f, out.data(), row.size()));
  row[9] = NAN;
  EXPECT_TRUE(contrastive::host::store_scaled_row(row.data(), 2.0f, out.data(), row.size()));
  EXPECT_EQ(traits::bits(out[9]), traits::bits(traits::from_float(NAN)));
  EXPECT_EQ(traits::to_float(out[0]), 0.5f);
#endif
}

// The row conversions of host/element_rows.hpp (F16C for half where the build targets it, the materialized
// algorithm's passes over its stored logits) give element_traits' values for every element type: every half to float,
// and float to half or bfloat16 and rounded to it (all exponents and signs, mantissas around every rounding boundary,
// random bit patterns; NaN to NaN), at lengths that leave a scalar tail.
template <class T>
void expect_rows_match_scalar_conversions()
{
  using traits = element_traits<T>;
  std::vector<float> in;
  for (std::uint32_t e = 0; e < 256; ++e)
  {
    for (std::uint32_t m : {0u,
                            1u,
                            0x7fffu,
                            0x8000u,
                            0x8001u,
                            0xfffu,
                            0x1000u,
                            0x1001u,
                            0x1fffu,
                            0x2000u,
                            0x3fffffu,
                            0x400000u,
                            0x400001u,
                            0x7fffffu})
    {
      for (std::uint32_t sign : {0u, 0x80000000u})
      {
        in.push_back(float_of(sign | e << 23 | m));
      }
    }
  }
  std::mt19937 rng(91);
  while (in.size() < (1u << 20) + 5) // not a multiple of 8
  {
    in.push_back(float_of(static_cast<std::uint32_t>(rng())));
  }
  const std::size_t n = in.size();
  std::vector<T> stored(n);
  contrastive::host::from_float_row(in.data(), n, stored.data());
  std::vector<float> rounded = in;
  contrastive::host::round_row<T>(rounded.data(), n);
  for (std::size_t i = 0; i < n; ++i)
  {
    const T want = traits::from_float(in[i]);
    if (std::isnan(in[i]))
    {
      ASSERT_TRUE(std::isnan(traits::to_float(stored[i]))) << i;
      ASSERT_TRUE(std::isnan(rounded[i])) << i;
      continue;
    }
    ASSERT_EQ(traits::bits(stored[i]), traits::bits(want)) << "x = " << in[i];
    ASSERT_EQ(bits_of(rounded[i]), bits_of(traits::to_float(want))) << "x = " << in[i];
  }
  std::vector<T> every(65536 + 3);
  for (std::size_t b = 0; b < every.size(); ++b)
  {
    every[b] = traits::from_bits(static_cast<std::uint16_t>(b));
  }
  std::vector<float> back(every.size());
  contrastive::host::to_float_row(every.data(), every.size(), back.data());
  for (std::size_t b = 0; b < every.size(); ++b)
  {
    const float want = traits::to_float(every[b]);
    if (std::isnan(want))
    {
      ASSERT_TRUE(std::isnan(back[b])) << b;
    }
    else
    {
      ASSERT_EQ(bits_of(back[b]), bits_of(want)) << "bits " << b;
    }
  }
}

TEST(ElementTraits, RowConversionsMatchTheScalarOnes)
{
  expect_rows_match_scalar_conversions<__half>();
  expect_rows_match_scalar_conversions<__nv_bfloat16>();
}

// The sigmoid objective's per-logit math (numeric/sigmoid_math.hpp): log1p_unit within 3 ulp of log1p over [0, 1],
// and softplus / sigmoid of both signs of pair within a few ulp of float64, including tiny terms (e^-80) and the
// masked slot z = -inf (exactly 0).
TEST(SigmoidMath, Log1pUnitAndTermsMatchFloat64)
{
  double worst = 0.0;
  for (int i = 0; i <= 200000; ++i)
  {
    const float e = i < 100000 ? static_cast<float>(i) / 100000.0f : std::ldexp(1.0f, -(i - 100000) / 800);
    const double want = std::log1p(static_cast<double>(e));
    if (want == 0.0)
    {
      EXPECT_EQ(contrastive::detail::log1p_unit(e), 0.0f);
      continue;
    }
    const double ulp = std::ldexp(1.0, std::ilogb(static_cast<float>(want)) - 23);
    worst = std::max(worst, std::fabs(contrastive::detail::log1p_unit(e) - want) / ulp);
  }
  EXPECT_LE(worst, 3.0);
  double worst_loss = 0.0, worst_grad = 0.0;
  for (int i = 0; i <= 40000; ++i)
  {
    const float z = -80.0f + 160.0f * static_cast<float>(i) / 40000.0f;
    const double zd = z;
    const double loss_neg = std::max(zd, 0.0) + std::log1p(std::exp(-std::fabs(zd))); // softplus(z)
    const double grad_neg = 1.0 / (1.0 + std::exp(-zd));                              // sigmoid(z)
    const contrastive::sigmoid_term n = contrastive::sigmoid_negative(z), p = contrastive::sigmoid_positive(-z);
    worst_loss = std::max(worst_loss, std::fabs(n.loss - loss_neg) / loss_neg);
    worst_grad = std::max(worst_grad, std::fabs(n.grad - grad_neg) / grad_neg);
    EXPECT_EQ(p.loss, n.loss); // softplus(-(-z)) of the positive at -z is the negative's term at z
    EXPECT_EQ(p.grad, -n.grad);
  }
  EXPECT_LE(worst_loss, 4 * 5.96e-8);
  EXPECT_LE(worst_grad, 4 * 5.96e-8);
  EXPECT_EQ(contrastive::sigmoid_negative(-INFINITY).loss, 0.0f);
  EXPECT_EQ(contrastive::sigmoid_negative(-INFINITY).grad, 0.0f);
  EXPECT_TRUE(std::isinf(contrastive::sigmoid_negative(INFINITY).loss));
  EXPECT_TRUE(std::isnan(contrastive::sigmoid_negative(NAN).loss));
}

namespace
{
// Random bfloat16 operands A (m x k) and B (n x k), magnitudes 2^-20..2^20, packed into the pair layouts (poisoned
// first: every slot must be written), and the check of a product C = C0 + A B^T (C0 = 0 unless given) against a
// float64 product of the same values: every product of two bfloat16 values is exact in float, so the only error is
// the float additions, at most `steps` rounding steps of 2^-24 relative to |C0| + sum |a b|.
struct bf16_operands
{
  std::size_t m, n, k, m_pad, n_pad, kc;
  std::vector<__nv_bfloat16> a, b;
  std::vector<std::uint16_t> ap, bp;

  bf16_operands(std::size_t m_, std::size_t n_, std::size_t k_, std::mt19937& rng)
      : m(m_), n(n_), k(k_), m_pad(contrastive::host::round_up(m_, contrastive::host::kernel_mr)),
        n_pad(contrastive::host::round_up(n_, contrastive::host::kernel_nr)), kc(contrastive::host::round_up(k_, 2)),
        a(m_ * k_), b(n_ * k_), ap(m_pad * kc, 0xffff), bp(n_pad * kc, 0xffff)
  {
    namespace h = contrastive::host;
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_int_distribution<int> exponent(-20, 20);
    for (auto* v : {&a, &b})
    {
      for (auto& x : *v)
      {
        x = __float2bfloat16_rn(std::ldexp(normal(rng), exponent(rng)));
      }
    }
    h::pack_row_pairs<h::kernel_mr>(a.data(), k, 0, m, m_pad, ap.data());
    h::pack_row_pairs<h::kernel_nr>(b.data(), k, 0, n, n_pad, bp.data());
  }

  /// Every element of c (m_pad x n_pad) within the bound; the first that is not fails the test and ends the check.
  void check(const std::vector<float>& c, const std::vector<float>* c0, double steps, const char* what) const
  {
    for (std::size_t i = 0; i < m_pad; ++i)
    {
      for (std::size_t j = 0; j < n_pad; ++j)
      {
        double ref = c0 != nullptr ? static_cast<double>((*c0)[i * n_pad + j]) : 0.0;
        double mag = std::fabs(ref);
        for (std::size_t p = 0; i < m && j < n && p < k; ++p)
        {
          const double x = static_cast<double>(__bfloat162float(a[i * k + p])) * __bfloat162float(b[j * k + p]);
          ref += x;
          mag += std::fabs(x);
        }
        const double got = c[i * n_pad + j];
        ASSERT_LE(std::fabs(got - ref), steps * std::ldexp(1.0, -24) * mag)
            << what << ": C[" << i << "][" << j << "] of " << m << " x " << n << " x " << k
            << (c0 != nullptr ? ", accumulated" : "");
      }
    }
  }
};

// The bfloat16 pair packers and dot-product kernel (host/gemm.hpp, host/operands.hpp): a chain is kernel_kc products
// (two additions per pair step) and the slices add one step each.
void check_bf16_product(std::size_t m, std::size_t n, std::size_t k, std::uint32_t seed)
{
#if !defined(__AVX512BF16__)
  (void)m, (void)n, (void)k, (void)seed; // no bfloat16 kernel in this build: the test below skips
#else
  namespace h = contrastive::host;
  std::mt19937 rng(seed);
  const bf16_operands x(m, n, k, rng);
  std::vector<float> c(x.m_pad * x.n_pad, std::numeric_limits<float>::quiet_NaN());
  h::gemm_packed(x.m_pad, x.n_pad, x.kc, x.ap.data(), x.bp.data(), x.kc * h::kernel_nr, c.data(), x.n_pad, false);
  const double steps = 2.0 * static_cast<double>(h::kernel_kc) + static_cast<double>(x.kc / h::kernel_kc + 2);
  x.check(c, nullptr, steps, h::bf16_kernel());
#endif
}
} // namespace

TEST(Bf16Dot, PackedProductMatchesFloat64)
{
  if (!contrastive::host::bf16_dot)
  {
    GTEST_SKIP() << "this build does not target AVX512-BF16 (bfloat16 runs on the float kernel)";
  }
  std::uint32_t seed = std::random_device{}();
  std::printf("seed %u\n", seed);
  for (std::size_t k : {1u, 2u, 7u, 64u, 129u, 512u, 515u})
  {
    check_bf16_product(13, 45, k, seed++);
    check_bf16_product(contrastive::host::kernel_mr, contrastive::host::kernel_nr, k, seed++);
  }
}

#if CONTRASTIVE_AMX_COMPILED
namespace
{
// The AMX driver (host/amx.hpp) over the pair layouts on tiles `Tiles`: a chain is one instruction's tile_pairs
// products, the even + odd sum and one addition into C per tile step (and C's own value when accumulating).
template <class Tiles>
std::vector<float> check_amx_product(std::size_t m, std::size_t n, std::size_t k, bool accumulate, std::uint32_t seed)
{
  namespace h = contrastive::host;
  std::mt19937 rng(seed);
  const bf16_operands x(m, n, k, rng);
  std::vector<float> c0(x.m_pad * x.n_pad, std::numeric_limits<float>::quiet_NaN());
  if (accumulate)
  {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_int_distribution<int> exponent(-20, 20);
    for (auto& v : c0)
    {
      v = std::ldexp(normal(rng), exponent(rng));
    }
  }
  std::vector<float> c = c0;
  Tiles tiles;
  h::amx::gemm_pairs(
      tiles, x.m_pad, x.n_pad, x.kc, x.ap.data(), x.bp.data(), x.kc * h::kernel_nr, c.data(), x.n_pad, accumulate);
  const std::size_t kp = x.kc / 2;
  const std::size_t tile_steps = (kp + h::amx::tile_pairs - 1) / h::amx::tile_pairs;
  const double steps =
      static_cast<double>(h::amx::tile_pairs + 2 + tile_steps + kp / h::amx::a_block_pairs + (accumulate ? 2 : 1));
  x.check(c, accumulate ? &c0 : nullptr, steps, "AMX tile driver");
  return c;
}

// Shapes that cover every edge of the driver: a row block of 8, 16, 24 or 32 rows (partial ones staged), a pair count
// that is not a multiple of a tile step (the B tail copied), more than a_block_pairs pairs (A copied in parts), k odd,
// k = 0, several column blocks.
struct amx_shape
{
  std::size_t m, n, k;
};
const amx_shape amx_shapes[] = {{1, 1, 1},
                                {8, 32, 2},
                                {16, 33, 31},
                                {24, 64, 32},
                                {32, 32, 64},
                                {40, 96, 33},
                                {72, 40, 2 * (256 + 16 + 5) + 1},
                                {33, 65, 1024},
                                {9, 17, 0}};
} // namespace

// The tile driver's layout logic on the SDM's operation, on every build that carries it.
TEST(AmxTiles, EmulatedProductMatchesFloat64)
{
  std::uint32_t seed = std::random_device{}();
  std::printf("seed %u\n", seed);
  for (const amx_shape& s : amx_shapes)
  {
    for (bool accumulate : {false, true})
    {
      check_amx_product<contrastive::host::amx::emulated_tiles>(s.m, s.n, s.k, accumulate, seed++);
    }
  }
}

// A row's sum does not depend on where the row sits: rows computed in a whole 32-row block and the same rows computed
// alone (a partial, staged block) are equal bit for bit, as exact_rows in the builtin backend assumes.
TEST(AmxTiles, PartialBlocksSumLikeWholeOnes)
{
  namespace h = contrastive::host;
  std::mt19937 rng(std::random_device{}());
  std::uniform_int_distribution<std::uint32_t> bits(0, 0xffff);
  const std::size_t m_pad = 40, n_pad = 64, kc = 2 * 300;
  std::vector<std::uint16_t> ap(m_pad * kc), bp(n_pad * kc);
  for (auto* v : {&ap, &bp})
  {
    for (auto& x : *v)
    {
      x = static_cast<std::uint16_t>(bits(rng) & 0xbfffu); // finite: exponent below 0xff
    }
  }
  for (bool accumulate : {false, true})
  {
    std::vector<float> whole(m_pad * n_pad, 0.5f), part(h::kernel_mr * n_pad, 0.5f);
    h::amx::emulated_tiles tiles;
    h::amx::gemm_pairs(
        tiles, m_pad, n_pad, kc, ap.data(), bp.data(), kc * h::kernel_nr, whole.data(), n_pad, accumulate);
    for (std::size_t r0 : {std::size_t{0}, std::size_t{16}, std::size_t{32}})
    {
      std::fill(part.begin(), part.end(), 0.5f);
      h::amx::gemm_pairs(tiles,
                         h::kernel_mr,
                         n_pad,
                         kc,
                         ap.data() + r0 * kc,
                         bp.data(),
                         kc * h::kernel_nr,
                         part.data(),
                         n_pad,
                         accumulate);
      for (std::size_t i = 0; i < part.size(); ++i)
      {
        ASSERT_EQ(bits_of(part[i]), bits_of(whole[r0 * n_pad + i]))
            << "row " << r0 + i / n_pad << ", column " << i % n_pad;
      }
    }
  }
}

namespace
{
// One call over `blocks` consecutive blocks of 64 steps of a deeper A (a_kc = 4 blocks) equals a call per block in
// order, bit for bit: the builtin backend's dK product (dk_depth) relies on it.
template <class Tiles>
void check_deep_reduction(std::size_t blocks, std::uint32_t seed)
{
  namespace h = contrastive::host;
  std::mt19937 rng(seed);
  std::uniform_int_distribution<std::uint32_t> bits(0, 0xffff);
  const std::size_t m_pad = 40, n_pad = 64, block = 64, a_kc = 4 * block;
  std::vector<std::uint16_t> ap(m_pad * a_kc), bp(n_pad * a_kc);
  for (auto* v : {&ap, &bp})
  {
    for (auto& x : *v)
    {
      x = static_cast<std::uint16_t>(bits(rng) & 0xbfffu); // finite: exponent below 0xff
    }
  }
  std::vector<float> deep(m_pad * n_pad), steps(m_pad * n_pad);
  std::normal_distribution<float> normal(0.0f, 4.0f);
  for (std::size_t i = 0; i < deep.size(); ++i)
  {
    deep[i] = steps[i] = normal(rng);
  }
  Tiles tiles;
  const std::size_t b_stride = a_kc * h::kernel_nr;
  h::amx::gemm_pairs(
      tiles, m_pad, n_pad, blocks * block, ap.data(), bp.data(), b_stride, deep.data(), n_pad, true, a_kc);
  for (std::size_t s = 0; s < blocks; ++s)
  {
    h::amx::gemm_pairs(tiles,
                       m_pad,
                       n_pad,
                       block,
                       ap.data() + s * block * h::kernel_mr,
                       bp.data() + s * block * h::kernel_nr,
                       b_stride,
                       steps.data(),
                       n_pad,
                       true,
                       a_kc);
  }
  for (std::size_t i = 0; i < deep.size(); ++i)
  {
    ASSERT_EQ(bits_of(deep[i]), bits_of(steps[i]))
        << blocks << " blocks, row " << i / n_pad << ", column " << i % n_pad;
  }
}
} // namespace

TEST(AmxTiles, DeepReductionsSumLikeOneCallPerBlock)
{
  std::uint32_t seed = std::random_device{}();
  std::printf("seed %u\n", seed);
  for (std::size_t blocks : {1u, 2u, 3u, 4u})
  {
    check_deep_reduction<contrastive::host::amx::emulated_tiles>(blocks, seed++);
    if (contrastive::host::amx::active())
    {
      check_deep_reduction<contrastive::host::amx::hardware_tiles>(blocks, seed++);
    }
  }
}

// The real tiles, where the CPU and the OS have them (skipped, with the reason, elsewhere): the same bound, and the
// builds's bfloat16 products (gemm_packed) run on them.
TEST(AmxTiles, HardwareProductMatchesFloat64)
{
  namespace h = contrastive::host;
  if (!h::amx::active())
  {
    GTEST_SKIP() << h::amx::describe(h::amx::status());
  }
  {
    // The configuration in force is all 64 bytes of the one the driver loads (a compiler that dropped its stores would
    // leave tiles of 0 rows).
    h::amx::hardware_tiles t;
    t.configure();
    const h::amx::tile_config in_force = h::amx::stored_config();
    t.release();
    EXPECT_EQ(std::memcmp(&in_force, &h::amx::block_tile_config, sizeof in_force), 0);
  }
  std::uint32_t seed = std::random_device{}();
  std::printf("seed %u\n", seed);
  std::size_t differ = 0, total = 0;
  for (const amx_shape& s : amx_shapes)
  {
    for (bool accumulate : {false, true})
    {
      const auto hw = check_amx_product<h::amx::hardware_tiles>(s.m, s.n, s.k, accumulate, seed);
      const auto em = check_amx_product<h::amx::emulated_tiles>(s.m, s.n, s.k, accumulate, seed);
      ++seed;
      for (std::size_t i = 0; i < hw.size() && i < em.size(); ++i)
      {
        differ += bits_of(hw[i]) != bits_of(em[i]);
      }
      total += hw.size();
    }
  }
  std::printf("hardware tiles differ from the SDM's operation in %zu of %zu results\n", differ, total);
  if (h::bf16_dot)
  {
    EXPECT_STREQ(h::bf16_kernel(), "amx_bf16");
  }
}
#endif

// G rounded to bfloat16 into the pair layouts (pack_a_pairs, pack_a_transposed_pairs): the bits of the scalar
// round-to-nearest-even conversion, zeros in the padding.
TEST(Bf16Dot, FloatPackersRoundToNearestEven)
{
  namespace h = contrastive::host;
  std::mt19937 rng(std::random_device{}());
  std::uniform_int_distribution<std::uint32_t> bits;
  for (int t = 0; t < 200000; ++t)
  {
    const std::uint32_t x = t < 4 ? std::uint32_t{0x7f800001u} + static_cast<std::uint32_t>(t) * 0x1000u : bits(rng);
    float f;
    std::memcpy(&f, &x, sizeof f);
    ASSERT_EQ(h::bf16_round_bits(f), contrastive::detail::float_to_bf16_bits(f)) << std::hex << x;
  }
  const std::size_t rows = 11, cols = 13, ld = 16, k_rows = 12;
  std::vector<float> tile(k_rows * ld);
  std::normal_distribution<float> normal;
  for (auto& x : tile)
  {
    x = normal(rng);
  }
  const std::size_t m_pad = h::round_up(rows, h::kernel_mr);
  std::vector<std::uint16_t> a(m_pad * h::round_up(cols, 2), 0xffff);
  const std::size_t kc = h::pack_a_pairs(tile.data(), ld, rows, m_pad, cols, a.data());
  ASSERT_EQ(kc, h::round_up(cols, 2));
  for (std::size_t r = 0; r < m_pad; ++r)
  {
    for (std::size_t p = 0; p < kc; ++p)
    {
      const std::uint16_t want = r < rows && p < cols ? h::bf16_round_bits(tile[r * ld + p]) : 0;
      ASSERT_EQ(a[(r / h::kernel_mr) * h::kernel_mr * kc + (p & ~std::size_t(1)) * h::kernel_mr +
                  2 * (r % h::kernel_mr) + (p & 1)],
                want)
          << r << ", " << p;
    }
  }
  const std::size_t c_pad = h::round_up(cols, h::kernel_mr);
  std::vector<std::uint16_t> t(c_pad * k_rows, 0xffff);
  h::pack_a_transposed_pairs(tile.data(), ld, cols, c_pad, k_rows, t.data());
  for (std::size_t c = 0; c < c_pad; ++c)
  {
    for (std::size_t p = 0; p < k_rows; ++p)
    {
      const std::uint16_t want = c < cols ? h::bf16_round_bits(tile[p * ld + c]) : 0;
      ASSERT_EQ(t[(c / h::kernel_mr) * h::kernel_mr * k_rows + (p & ~std::size_t(1)) * h::kernel_mr +
                  2 * (c % h::kernel_mr) + (p & 1)],
                want)
          << c << ", " << p;
    }
  }
}
