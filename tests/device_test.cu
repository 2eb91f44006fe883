// Device path tests: the same cases as the host tests, compared with the host path and the float64 reference.
// Without a CUDA device every test skips with one message; CI still compiles this file for sm_80 and sm_90.

#include "test_util.hpp"

#include <contrastive/device/loss.cuh>

#include <gtest/gtest.h>

#include <cstring>
#include <string>

namespace cl = contrastive;
namespace ct = contrastive_test;
using ct::config;
using ct::config_names;
using ct::shape;
using ct::shapes;

namespace
{
std::string device_unavailable()
{
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess)
  {
    return std::string("no CUDA device (") + cudaGetErrorString(err) + "): device tests skipped";
  }
  return count == 0 ? "no CUDA device: device tests skipped" : "";
}

#define SKIP_WITHOUT_DEVICE()                                                                                          \
  do                                                                                                                   \
  {                                                                                                                    \
    const std::string why = device_unavailable();                                                                      \
    if (!why.empty())                                                                                                  \
      GTEST_SKIP() << why;                                                                                             \
  } while (0)

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

template <class T>
struct device_buffer
{
  T* ptr = nullptr;
  std::size_t n = 0;
  explicit device_buffer(std::size_t count) : n(count)
  {
    if (cudaMalloc(&ptr, (count == 0 ? 1 : count) * sizeof(T)) != cudaSuccess)
    {
      ptr = nullptr;
    }
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer()
  {
    cudaFree(ptr);
  }
  cudaError_t upload(const std::vector<T>& v)
  {
    return cudaMemcpy(ptr, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  cudaError_t poison(unsigned char byte)
  {
    return cudaMemset(ptr, byte, n * sizeof(T));
  }
  std::vector<T> download() const
  {
    std::vector<T> v(n);
    cudaMemcpy(v.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost);
    return v;
  }
};

template <class T>
float start_scale()
{
  return std::is_same_v<T, float> ? 1.0f : 256.0f;
}
} // namespace

template <class C>
class DeviceTyped : public ::testing::Test
{
};

using device_configs = ::testing::Types<
#define CONTRASTIVE_DEVICE_CONFIGS(T)                                                                                  \
  config<T, cl::temperature::fixed, cl::scaler::static_scale, cl::algorithm::fused>,                                   \
      config<T, cl::temperature::learnable, cl::scaler::dynamic, cl::algorithm::fused>,                                \
      config<T, cl::temperature::clamped, cl::scaler::dynamic, cl::algorithm::materialized>,                           \
      config<T, cl::temperature::scheduled, cl::scaler::static_scale, cl::algorithm::materialized>
    CONTRASTIVE_DEVICE_CONFIGS(float),
    CONTRASTIVE_DEVICE_CONFIGS(__half),
    CONTRASTIVE_DEVICE_CONFIGS(__nv_bfloat16)
#undef CONTRASTIVE_DEVICE_CONFIGS
    >;

TYPED_TEST_SUITE(DeviceTyped, device_configs, config_names);

template <class Temp>
Temp device_temperature()
{
  if constexpr (std::is_same_v<Temp, cl::temperature::fixed>)
  {
    return cl::temperature::fixed(0.1f);
  }
  else if constexpr (std::is_same_v<Temp, cl::temperature::learnable>)
  {
    return cl::temperature::learnable(0.1f, cl::optimizer::adam(1e-2f));
  }
  else if constexpr (std::is_same_v<Temp, cl::temperature::clamped>)
  {
    return cl::temperature::clamped(0.1f, 0.05f, 1.0f, cl::optimizer::adam(1e-2f));
  }
  else
  {
    return cl::temperature::scheduled::freeze_then_learn(0.1f, 1, cl::optimizer::adam(1e-2f));
  }
}

template <class T, class Scale>
Scale device_scaler()
{
  if constexpr (std::is_same_v<Scale, cl::scaler::static_scale>)
  {
    return cl::scaler::static_scale(start_scale<T>());
  }
  else
  {
    auto d = cl::scaler::dynamic::torch();
    d.scale = start_scale<T>();
    return d;
  }
}

// Device vs host path vs float64: loss, dQ, dK, d loss / d log s, and the policies after two steps.
TYPED_TEST(DeviceTyped, MatchesHostPathAndFloat64Reference)
{
  SKIP_WITHOUT_DEVICE();
  using T = typename TypeParam::element;
  using Temp = typename TypeParam::temperature;
  using Scale = typename TypeParam::scaler;
  using Algo = typename TypeParam::algorithm;
  using device_loss = cl::device::loss<T, Temp, Scale, Algo>;
  using tol = ct::tolerance<T, Algo>;
  std::uint32_t seed = 500;
  for (const shape& sh : shapes)
  {
    SCOPED_TRACE("n_q " + std::to_string(sh.n_q) + " n_k " + std::to_string(sh.n_k) + " dim " + std::to_string(sh.dim));
    const auto q = ct::random_rows<T>(sh.n_q, sh.dim, ++seed);
    const auto k = ct::random_rows<T>(sh.n_k, sh.dim, ++seed);
    std::vector<std::int32_t> labels(sh.n_q);
    std::mt19937 rng(++seed);
    for (auto& l : labels)
    {
      l = static_cast<std::int32_t>(rng() % sh.n_k);
    }
    device_buffer<T> d_q(q.size()), d_k(k.size()), d_dq(q.size()), d_dk(k.size());
    device_buffer<std::int32_t> d_labels(labels.size());
    CUDA_OK(d_q.upload(q));
    CUDA_OK(d_k.upload(k));
    CUDA_OK(d_labels.upload(labels));
    cl::problem<T> hp{q.data(), k.data(), sh.n_q, sh.n_k, sh.dim, sh.labels ? labels.data() : nullptr, sh.obj};
    cl::problem<T> dp{d_q.ptr, d_k.ptr, sh.n_q, sh.n_k, sh.dim, sh.labels ? d_labels.ptr : nullptr, sh.obj};

    cl::loss<T, Temp, Scale, Algo> host(device_temperature<Temp>(), device_scaler<T, Scale>());
    typename device_loss::state_type init{};
    ASSERT_TRUE(device_loss::make_state(device_temperature<Temp>(), device_scaler<T, Scale>(), init).ok());
    device_buffer<typename device_loss::state_type> d_state(1);
    CUDA_OK(cudaMemcpy(d_state.ptr, &init, sizeof(init), cudaMemcpyHostToDevice));
    std::size_t bytes = 0;
    CUDA_OK(device_loss::step(nullptr, bytes, dp, d_dq.ptr, d_dk.ptr, d_state.ptr));
    device_buffer<unsigned char> temp(bytes);
    // A workspace one byte short is refused.
    std::size_t short_bytes = bytes - 1;
    EXPECT_EQ(device_loss::step(temp.ptr, short_bytes, dp, d_dq.ptr, d_dk.ptr, d_state.ptr), cudaErrorInvalidValue);

    for (int step = 0; step < 2; ++step)
    {
      SCOPED_TRACE("step " + std::to_string(step));
      const double s = host.temperature().scale();
      const auto ref =
          ct::compute_reference(ct::to_double(q), ct::to_double(k), sh.n_q, sh.n_k, sh.dim, hp.labels, sh.obj, s);
      std::vector<T> hdq(q.size()), hdk(k.size());
      cl::step_record hrec;
      ASSERT_TRUE(host.step(hp, hdq.data(), hdk.data(), hrec).ok());
      CUDA_OK(d_dq.poison(0xff)); // NaN patterns: unwritten elements fail the comparison
      CUDA_OK(d_dk.poison(0xff));
      CUDA_OK(device_loss::step(temp.ptr, bytes, dp, d_dq.ptr, d_dk.ptr, d_state.ptr));
      CUDA_OK(cudaDeviceSynchronize());
      typename device_loss::state_type st{};
      CUDA_OK(cudaMemcpy(&st, d_state.ptr, sizeof(st), cudaMemcpyDeviceToHost));
      const cl::step_record& rec = st.record;
      EXPECT_EQ(rec.first_nonfinite, cl::nonfinite_site::none);
      EXPECT_FALSE(rec.skipped);
      EXPECT_EQ(rec.loss_scale, hrec.loss_scale);
      EXPECT_NEAR(rec.loss, ref.loss, tol::loss(ref.max_abs_logit));
      EXPECT_NEAR(rec.loss, hrec.loss, 2 * tol::loss(ref.max_abs_logit));
      const auto ddq = d_dq.download();
      const auto ddk = d_dk.download();
      const double ls = rec.loss_scale;
      // Tensor-core products round G to the element type once more than the host does: allow one more u_T.
      const double gtol = tol::grad(ref.max_abs_logit) + ct::tolerance<T, Algo>::u_t;
      EXPECT_LE(ct::max_rel_error(ddq, ref.dq, 1.0 / ls), gtol);
      EXPECT_LE(ct::max_rel_error(ddk, ref.dk, 1.0 / ls), gtol);
      EXPECT_NEAR(rec.grad_logit_scale, ref.grad_logit_scale, gtol * (1.0 + ref.max_abs_logit) + 1e-6);
      EXPECT_NEAR(st.temperature.tau(), host.temperature().tau(), 1e-3 * host.temperature().tau());
      EXPECT_EQ(st.scaler.loss_scale(), host.scaler().loss_scale());
      EXPECT_EQ(st.step, host.steps());
    }
  }
}

// The seed's failure on the GPU: materialized fp16 logits past 65504 are diagnosed, the step skipped, the
// temperature untouched and the scaler backed off, all on the device.
TEST(Device, Fp16LogitsOverflowIsDiagnosedAndSkipped)
{
  SKIP_WITHOUT_DEVICE();
  using device_loss =
      cl::device::loss<__half, cl::temperature::learnable, cl::scaler::dynamic, cl::algorithm::materialized>;
  const std::size_t n = 16, dim = 8;
  const auto q = ct::random_rows<__half>(n, dim, 91);
  device_buffer<__half> d_q(q.size()), d_dq(q.size()), d_dk(q.size());
  CUDA_OK(d_q.upload(q));
  cl::problem<__half> p{d_q.ptr, d_q.ptr, n, n, dim, nullptr, cl::objective::symmetric};
  device_loss::state_type init{};
  ASSERT_TRUE(
      device_loss::make_state(cl::temperature::learnable(1.0f / 70000.0f), cl::scaler::dynamic::torch(), init).ok());
  device_buffer<device_loss::state_type> d_state(1);
  CUDA_OK(cudaMemcpy(d_state.ptr, &init, sizeof(init), cudaMemcpyHostToDevice));
  std::size_t bytes = 0;
  CUDA_OK(device_loss::step(nullptr, bytes, p, d_dq.ptr, d_dk.ptr, d_state.ptr));
  device_buffer<unsigned char> temp(bytes);
  CUDA_OK(device_loss::step(temp.ptr, bytes, p, d_dq.ptr, d_dk.ptr, d_state.ptr));
  device_loss::state_type st{};
  CUDA_OK(cudaMemcpy(&st, d_state.ptr, sizeof(st), cudaMemcpyDeviceToHost));
  EXPECT_TRUE(st.record.skipped);
  EXPECT_EQ(st.record.first_nonfinite, cl::nonfinite_site::logits);
  EXPECT_EQ(st.temperature.theta, init.temperature.theta);
  EXPECT_EQ(st.scaler.scale, 32768.0f);
  EXPECT_EQ(st.step, 1);
}

// Bad arguments are refused with cudaErrorInvalidValue before anything is launched.
TEST(Device, BadArgumentsAreRefused)
{
  using device_loss = cl::device::loss<float, cl::temperature::fixed, cl::scaler::static_scale>;
  std::size_t bytes = 0;
  cl::problem<float> p{};
  device_loss::state_type* no_state = nullptr;
  EXPECT_EQ(device_loss::step(nullptr, bytes, p, nullptr, nullptr, no_state), cudaErrorInvalidValue);
  float dummy = 0.0f;
  cl::problem<float> q{&dummy, &dummy, 1, 2, 1, nullptr, cl::objective::symmetric};
  EXPECT_EQ(device_loss::step(nullptr, bytes, q, &dummy, &dummy, no_state), cudaErrorInvalidValue);
}

// Sizes whose byte counts overflow and outputs that alias are refused by the size query itself, before any CUDA call
// (so this runs without a device too).
TEST(Device, OversizedAndAliasedProblemsAreRefused)
{
  using fused = cl::device::loss<__half, cl::temperature::learnable, cl::scaler::dynamic, cl::algorithm::fused>;
  using mat = cl::device::loss<__half, cl::temperature::learnable, cl::scaler::dynamic, cl::algorithm::materialized>;
  alignas(256) static unsigned char fake_state[sizeof(fused::state_type)];
  auto* state = reinterpret_cast<fused::state_type*>(fake_state);
  auto* mstate = reinterpret_cast<mat::state_type*>(fake_state);
  std::vector<__half> q(64), k(64), dq(64), dk(64);
  const std::size_t huge[][3] = {{(std::size_t(1) << 60) + 1, (std::size_t(1) << 60) + 1, 16},
                                 {100, 100, std::size_t(1) << 62},
                                 {100, 100, ~std::size_t(0)},
                                 {std::size_t(1) << 31, std::size_t(1) << 31, 1}};
  for (const auto& s : huge)
  {
    std::size_t bytes = 12345;
    const cl::problem<__half> p{q.data(), k.data(), s[0], s[1], s[2], nullptr, cl::objective::symmetric};
    EXPECT_EQ(fused::step(nullptr, bytes, p, dq.data(), dk.data(), state), cudaErrorInvalidValue);
    EXPECT_EQ(mat::step(nullptr, bytes, p, dq.data(), dk.data(), mstate), cudaErrorInvalidValue);
    EXPECT_EQ(bytes, 12345u) << "a refused size query must not write the size";
  }
  std::size_t bytes = 0;
  const cl::problem<__half> p{q.data(), k.data(), 8, 8, 8, nullptr, cl::objective::symmetric};
  EXPECT_EQ(fused::step(nullptr, bytes, p, dq.data(), dq.data(), state), cudaErrorInvalidValue);
  EXPECT_EQ(fused::step(nullptr, bytes, p, const_cast<__half*>(p.q), dk.data(), state), cudaErrorInvalidValue);
}
