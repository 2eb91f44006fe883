// Device path tests: the same cases as the host tests, compared with the host path and the float64 reference.
// Without a CUDA device every test skips with one message; CI still compiles this file for sm_80 and sm_90.

#include "device_util.cuh"
#include "test_util.hpp"

#include <contrastive/device/loss.cuh>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
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
using ct::device_buffer;

#define SKIP_WITHOUT_DEVICE() CONTRASTIVE_SKIP_WITHOUT_DEVICE()
#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

template <class V>
double max_abs(const std::vector<V>& v)
{
  double m = 0.0;
  for (const V& x : v)
  {
    if constexpr (std::is_same_v<V, double>)
    {
      m = std::max(m, std::fabs(x));
    }
    else
    {
      m = std::max(m, std::fabs(double(cl::element_traits<V>::to_float(x))));
    }
  }
  return m;
}

// The most rows whose positive is one key (labels; else the diagonal: 1).
double positives_per_key(const std::int32_t* labels, std::size_t n_q, std::size_t n_k)
{
  if (labels == nullptr)
  {
    return 1.0;
  }
  std::vector<int> count(n_k, 0);
  int most = 0;
  for (std::size_t i = 0; i < n_q; ++i)
  {
    most = std::max(most, ++count[static_cast<std::size_t>(labels[i])]);
  }
  return most;
}

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
      // materialized: plus the positive's P_pp - 1 formed by subtraction (the frameworks' form; test_util.hpp).
      const cl::grad_coefficients gc = cl::objectives::visit(sh.obj,
                                                             [&](auto o)
                                                             {
                                                               return decltype(o)::coefficients(sh.n_q, sh.n_k);
                                                             });
      const double coef_sum = double(gc.row_coef) + (sh.obj == cl::objective::symmetric ? double(gc.col_coef) : 0.0);
      EXPECT_LE(ct::max_rel_error(ddq, ref.dq, 1.0 / ls),
                gtol + tol::positive_subtraction(s, coef_sum, max_abs(k), 1.0, max_abs(ref.dq)));
      EXPECT_LE(ct::max_rel_error(ddk, ref.dk, 1.0 / ls),
                gtol + tol::positive_subtraction(
                           s, coef_sum, max_abs(q), positives_per_key(hp.labels, sh.n_q, sh.n_k), max_abs(ref.dk)));
      EXPECT_NEAR(rec.grad_logit_scale, ref.grad_logit_scale, gtol * (1.0 + ref.max_abs_logit) + 1e-6);
      EXPECT_NEAR(st.temperature.tau(), host.temperature().tau(), 1e-3 * host.temperature().tau());
      EXPECT_EQ(st.scaler.loss_scale(), host.scaler().loss_scale());
      EXPECT_EQ(st.step, host.steps());
    }
  }
}

// The fp16 collapse's failure (docs/collapse.md) on the GPU: materialized fp16 logits past 65504 are diagnosed, the
// step skipped, the temperature untouched and the scaler backed off, all on the device.
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
  float dummy[8] = {};
  cl::problem<float> q{dummy, dummy, 1, 2, 1, nullptr, cl::objective::symmetric};
  EXPECT_EQ(device_loss::step(nullptr, bytes, q, dummy, dummy, no_state), cudaErrorInvalidValue);

  // check() gives the reason, naming the argument, without a device (the PyTorch binding raises it).
  alignas(256) static unsigned char fake_state[sizeof(device_loss::state_type)];
  auto* state = reinterpret_cast<device_loss::state_type*>(fake_state); // never dereferenced
  EXPECT_EQ(device_loss::check(p, nullptr, nullptr, state).argument(), "n_q");
  EXPECT_EQ(device_loss::check(q, dummy + 4, dummy + 6, state).code(), cl::errc::shape_mismatch); // n_q != n_k
  cl::problem<float> ok{dummy, dummy + 1, 1, 1, 1, nullptr, cl::objective::symmetric};
  EXPECT_EQ(device_loss::check(ok, dummy + 2, dummy + 3, no_state).code(), cl::errc::null_pointer);
  EXPECT_EQ(device_loss::check(ok, dummy + 2, dummy + 3, no_state).argument(), "d_state");
  EXPECT_EQ(device_loss::check(ok, nullptr, dummy + 3, state).argument(), "dq");
  cl::problem<float> sig = ok;
  sig.obj = cl::objective::sigmoid;
  EXPECT_EQ(device_loss::check(sig, dummy + 2, dummy + 3, state).argument(), "obj");
  EXPECT_EQ(device_loss::step(nullptr, bytes, sig, dummy + 2, dummy + 3, state), cudaErrorInvalidValue);
  // Beyond the device's limits: addresses 1 TiB apart, so the operands do not overlap (never dereferenced).
  const auto at = [](int tib)
  {
    return reinterpret_cast<float*>(static_cast<std::uintptr_t>(tib) << 40);
  };
  cl::problem<float> wide{at(1), at(2), 1, 1, (std::size_t(1) << 24) + 1, nullptr, cl::objective::symmetric};
  EXPECT_EQ(device_loss::check(wide, at(3), at(4), state).code(), cl::errc::size_overflow);
  EXPECT_EQ(device_loss::check(wide, at(3), at(4), state).argument(), "dim");
  EXPECT_TRUE(device_loss::check(ok, dummy + 2, dummy + 3, state).ok());
}

// The status calls: an argument the call refuses is named as check() names it, the workspace's verdict is a status of
// its own, and a CUDA failure carries CUDA's code, the same code the CUB-style call returns (without a device, the
// size query's own CUDA calls fail: that failure is the case tested here; with one, the workspace verdicts).
TEST(Device, StatusCallsNameTheArgumentOrCarryCudasCode)
{
  using L = cl::device::loss<float, cl::temperature::fixed, cl::scaler::static_scale>;
  alignas(256) static unsigned char fake_state[sizeof(L::state_type)];
  auto* state = reinterpret_cast<L::state_type*>(fake_state); // never dereferenced
  float dummy[8] = {};
  std::size_t bytes = 0;
  const cl::problem<float> ok{dummy, dummy + 1, 1, 1, 1, nullptr, cl::objective::symmetric};
  cl::problem<float> sig = ok;
  sig.obj = cl::objective::sigmoid;
  EXPECT_EQ(L::step_status(nullptr, bytes, sig, dummy + 2, dummy + 3, state).argument(), "obj");
  EXPECT_EQ(L::step_status(nullptr, bytes, ok, dummy + 2, dummy + 3, nullptr).argument(), "d_state");
  EXPECT_EQ(L::step_status(nullptr, bytes, ok, nullptr, dummy + 3, state).code(), cl::errc::null_pointer);
  EXPECT_EQ(L::step_status(nullptr, bytes, ok, nullptr, dummy + 3, state).native().api, cl::native_api::none);

  // The workspace's verdict (host code).
  EXPECT_EQ(cl::device::util::workspace_status(nullptr, 10, 20).code(), cl::errc::workspace_too_small);
  EXPECT_EQ(cl::device::util::workspace_status(nullptr, 10, 20).argument(), "temp_bytes");
  EXPECT_EQ(cl::device::util::workspace_status(fake_state + 8, 20, 20).argument(), "d_temp");
  EXPECT_TRUE(cl::device::util::workspace_status(fake_state, 20, 20).ok());

  // A CUDA result as a status and back.
  const cl::status oom = cl::detail::cuda_status(cudaErrorMemoryAllocation, "cudaMalloc");
  EXPECT_EQ(oom.code(), cl::errc::cuda_error);
  EXPECT_EQ(oom.argument(), "cudaMalloc");
  EXPECT_EQ(oom.native().api, cl::native_api::cuda);
  EXPECT_EQ(oom.native().code, static_cast<int>(cudaErrorMemoryAllocation));
  EXPECT_NE(oom.message().find("cudaErrorMemoryAllocation"), std::string::npos) << oom.message();
  EXPECT_EQ(cl::device::util::cuda_error_of(oom), cudaErrorMemoryAllocation);
  EXPECT_EQ(cl::device::util::cuda_error_of(cl::device::util::workspace_status(nullptr, 1, 2)), cudaErrorInvalidValue);
  EXPECT_EQ(cl::device::util::cuda_error_of(cl::status{}), cudaSuccess);
  EXPECT_TRUE(cl::detail::cuda_status(cudaSuccess, "x").ok());

  // A real call: the size query of a valid problem.
  std::size_t query = 0;
  const cl::status st = L::forward_backward_status(nullptr, query, ok, dummy + 2, dummy + 3, state);
  std::size_t query_cub = 0;
  const cudaError_t e = L::forward_backward(nullptr, query_cub, ok, dummy + 2, dummy + 3, state);
  EXPECT_EQ(cl::device::util::cuda_error_of(st), e) << st.message();
  if (!contrastive_test::device_unavailable().empty())
  {
    ASSERT_FALSE(st.ok()) << "without a device the size query's CUDA calls fail";
    EXPECT_EQ(st.code(), cl::errc::cuda_error);
    EXPECT_EQ(st.native().api, cl::native_api::cuda);
    EXPECT_NE(st.native().code, 0);
    EXPECT_NE(st.message().find(cudaGetErrorName(static_cast<cudaError_t>(st.native().code))), std::string::npos)
        << st.message();
    return;
  }
  ASSERT_TRUE(st.ok()) << st.message();
  EXPECT_EQ(query, query_cub);
  EXPECT_GT(query, 0u);
  // A workspace one byte short, then a misaligned one: named, and nothing launched (the state is not a device one).
  std::size_t short_bytes = query - 1;
  EXPECT_EQ(L::forward_backward_status(fake_state, short_bytes, ok, dummy + 2, dummy + 3, state).argument(),
            "temp_bytes");
  std::size_t all_bytes = query;
  EXPECT_EQ(L::forward_backward_status(fake_state + 8, all_bytes, ok, dummy + 2, dummy + 3, state).argument(),
            "d_temp");
}

// upload_state: a null state is refused before any launch (runs without a device); on a device the state lands in
// stream order on a non-blocking stream, byte for byte, from a host object gone out of scope.
TEST(Device, UploadStateWritesTheStateInStreamOrder)
{
  using L = cl::device::loss<__nv_bfloat16, cl::temperature::learnable, cl::scaler::dynamic>;
  L::state_type st;
  ASSERT_TRUE(L::make_state(cl::temperature::learnable(0.07f), cl::scaler::dynamic::torch(), st).ok());
  EXPECT_EQ(L::upload_state(st, nullptr), cudaErrorInvalidValue);
  CONTRASTIVE_SKIP_WITHOUT_DEVICE();
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  device_buffer<L::state_type> d_state(1);
  ASSERT_EQ(cudaMemsetAsync(d_state.ptr, 0xff, sizeof(L::state_type), s), cudaSuccess);
  L::state_type expect;
  std::memcpy(&expect, &st, sizeof st); // byte copies, so that padding compares too
  expect.step = 41;
  {
    L::state_type scoped; // out of scope before the stream runs the kernel
    std::memcpy(&scoped, &expect, sizeof expect);
    ASSERT_EQ(L::upload_state(scoped, d_state.ptr, s), cudaSuccess);
  }
  L::state_type back;
  ASSERT_EQ(cudaMemcpyAsync(&back, d_state.ptr, sizeof back, cudaMemcpyDeviceToHost, s), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  EXPECT_EQ(0, std::memcmp(&back, &expect, sizeof back));
  EXPECT_EQ(back.step, 41);
  EXPECT_EQ(back.temperature.tau(), st.temperature.tau());
  cudaStreamDestroy(s);
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

namespace
{
// Owners of a stream, a graph and its executable instance, so that a failed assertion leaks none of them.
struct stream_guard
{
  cudaStream_t s = nullptr;
  ~stream_guard()
  {
    if (s != nullptr)
    {
      cudaStreamDestroy(s);
    }
  }
};

struct graph_guard
{
  cudaGraph_t g = nullptr;
  cudaGraphExec_t exec = nullptr;
  ~graph_guard()
  {
    if (exec != nullptr)
    {
      cudaGraphExecDestroy(exec);
    }
    if (g != nullptr)
    {
      cudaGraphDestroy(g);
    }
  }
};

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b)
{
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// Equal values, any NaN matching any NaN (the GPU's products return the canonical NaN, the host's keep the input's).
bool same_values(const std::vector<float>& a, const std::vector<float>& b)
{
  if (a.size() != b.size())
  {
    return false;
  }
  for (std::size_t i = 0; i < a.size(); ++i)
  {
    if (!(a[i] == b[i] || (std::isnan(a[i]) && std::isnan(b[i]))))
    {
      return false;
    }
  }
  return true;
}

// Field by field (the struct has padding): the same kernels in the same order give the same bits.
void expect_same_record(const cl::step_record& got, const cl::step_record& want)
{
  EXPECT_EQ(got.step, want.step);
  EXPECT_EQ(got.loss, want.loss);
  EXPECT_EQ(got.tau, want.tau);
  EXPECT_EQ(got.loss_scale, want.loss_scale);
  EXPECT_EQ(got.next_loss_scale, want.next_loss_scale);
  EXPECT_EQ(got.grad_logit_scale, want.grad_logit_scale);
  EXPECT_EQ(got.max_logit, want.max_logit);
  EXPECT_EQ(got.skipped, want.skipped);
  EXPECT_EQ(got.first_nonfinite, want.first_nonfinite);
  EXPECT_EQ(got.pending, want.pending);
}
} // namespace

// One whole step captured in a CUDA graph on a non-default stream, then replayed twice, gives bit for bit what two
// eager steps give from the same initial state: dQ, dK, the policies and the step record after each replay. The
// step reads tau and the loss scale on the device, so the replays follow the state as it moves.
TYPED_TEST(DeviceTyped, GraphReplayMatchesEagerSteps)
{
  SKIP_WITHOUT_DEVICE();
  using T = typename TypeParam::element;
  using Temp = typename TypeParam::temperature;
  using Scale = typename TypeParam::scaler;
  using device_loss = cl::device::loss<T, Temp, Scale, typename TypeParam::algorithm>;
  using state_type = typename device_loss::state_type;
  const std::size_t n = 130, dim = 65; // not multiples of the tiles
  const auto q = ct::random_rows<T>(n, dim, 7101);
  const auto k = ct::random_rows<T>(n, dim, 7102);
  device_buffer<T> d_q(q.size()), d_k(k.size()), d_dq(q.size()), d_dk(k.size());
  CUDA_OK(d_q.upload(q));
  CUDA_OK(d_k.upload(k));
  const cl::problem<T> dp{d_q.ptr, d_k.ptr, n, n, dim, nullptr, cl::objective::symmetric};
  state_type init{};
  ASSERT_TRUE(device_loss::make_state(device_temperature<Temp>(), device_scaler<T, Scale>(), init).ok());
  device_buffer<state_type> d_state(1);
  std::size_t bytes = 0;
  CUDA_OK(device_loss::step(nullptr, bytes, dp, d_dq.ptr, d_dk.ptr, d_state.ptr));
  device_buffer<unsigned char> temp(bytes);
  stream_guard stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream.s, cudaStreamNonBlocking));

  // Eager: two steps on the stream.
  std::vector<T> eager_dq[2], eager_dk[2];
  state_type eager_state[2]{};
  CUDA_OK(cudaMemcpy(d_state.ptr, &init, sizeof(init), cudaMemcpyHostToDevice));
  CUDA_OK(cudaDeviceSynchronize()); // the stream does not wait for the legacy default stream's copies
  for (int i = 0; i < 2; ++i)
  {
    CUDA_OK(device_loss::step(temp.ptr, bytes, dp, d_dq.ptr, d_dk.ptr, d_state.ptr, stream.s));
    CUDA_OK(cudaStreamSynchronize(stream.s));
    eager_dq[i] = d_dq.download();
    eager_dk[i] = d_dk.download();
    CUDA_OK(cudaMemcpy(&eager_state[i], d_state.ptr, sizeof(state_type), cudaMemcpyDeviceToHost));
    ASSERT_EQ(eager_state[i].record.first_nonfinite, cl::nonfinite_site::none);
  }

  // Graph: the same initial state, the outputs poisoned, one step captured and replayed twice.
  CUDA_OK(cudaMemcpy(d_state.ptr, &init, sizeof(init), cudaMemcpyHostToDevice));
  CUDA_OK(d_dq.poison(0xff));
  CUDA_OK(d_dk.poison(0xff));
  CUDA_OK(cudaDeviceSynchronize());
  graph_guard graph;
  CUDA_OK(cudaStreamBeginCapture(stream.s, cudaStreamCaptureModeGlobal));
  const cudaError_t captured = device_loss::step(temp.ptr, bytes, dp, d_dq.ptr, d_dk.ptr, d_state.ptr, stream.s);
  const cudaError_t ended = cudaStreamEndCapture(stream.s, &graph.g); // always end the capture, even after a failure
  ASSERT_EQ(captured, cudaSuccess) << cudaGetErrorString(captured);
  ASSERT_EQ(ended, cudaSuccess) << cudaGetErrorString(ended);
  CUDA_OK(cudaGraphInstantiate(&graph.exec, graph.g, 0));
  for (int i = 0; i < 2; ++i)
  {
    SCOPED_TRACE("replay " + std::to_string(i));
    CUDA_OK(cudaGraphLaunch(graph.exec, stream.s));
    CUDA_OK(cudaStreamSynchronize(stream.s));
    EXPECT_TRUE(same_bits(d_dq.download(), eager_dq[i]));
    EXPECT_TRUE(same_bits(d_dk.download(), eager_dk[i]));
    state_type st{};
    CUDA_OK(cudaMemcpy(&st, d_state.ptr, sizeof(st), cudaMemcpyDeviceToHost));
    EXPECT_EQ(st.step, eager_state[i].step);
    EXPECT_EQ(st.temperature.tau(), eager_state[i].temperature.tau());
    EXPECT_EQ(st.scaler.loss_scale(), eager_state[i].scaler.loss_scale());
    expect_same_record(st.record, eager_state[i].record);
  }
  // Two replays are two steps: the second one ran at the first one's updated state.
  EXPECT_EQ(eager_state[1].step, 2);
}

template <class T>
class DeviceUnscale : public ::testing::Test
{
};

class element_names
{
public:
  template <class T>
  static std::string GetName(int)
  {
    return cl::element_traits<T>::name;
  }
};

using device_elements = ::testing::Types<float, __half, __nv_bfloat16>;
TYPED_TEST_SUITE(DeviceUnscale, device_elements, element_names);

// The device's unscale_and_check: random finite gradients come back multiplied by 1/loss_scale exactly as the host
// path multiplies them (and within float rounding of the float64 quotient), the step stays finite; an injected inf
// and NaN flag the step (site `parameters`), finish_step then skips it: theta unchanged, the dynamic scaler backs off.
// Without a pending step the kernel changes nothing.
TYPED_TEST(DeviceUnscale, UnscalesAndFlagsNonFiniteGradients)
{
  SKIP_WITHOUT_DEVICE();
  using T = TypeParam;
  using Temp = cl::temperature::learnable;
  using Scale = cl::scaler::dynamic;
  using device_loss = cl::device::loss<T, Temp, Scale, cl::algorithm::fused>;
  using state_type = typename device_loss::state_type;
  using tol = ct::tolerance<T, cl::algorithm::fused>;
  const std::size_t n = 70, dim = 37;
  const auto q = ct::random_rows<T>(n, dim, 7201);
  const auto k = ct::random_rows<T>(n, dim, 7202);
  device_buffer<T> d_q(q.size()), d_k(k.size()), d_dq(q.size()), d_dk(k.size());
  CUDA_OK(d_q.upload(q));
  CUDA_OK(d_k.upload(k));
  const cl::problem<T> dp{d_q.ptr, d_k.ptr, n, n, dim, nullptr, cl::objective::symmetric};
  state_type init{};
  ASSERT_TRUE(device_loss::make_state(device_temperature<Temp>(), device_scaler<T, Scale>(), init).ok());
  device_buffer<state_type> d_state(1);
  CUDA_OK(cudaMemcpy(d_state.ptr, &init, sizeof(init), cudaMemcpyHostToDevice));
  std::size_t bytes = 0;
  CUDA_OK(device_loss::forward_backward(nullptr, bytes, dp, d_dq.ptr, d_dk.ptr, d_state.ptr));
  device_buffer<unsigned char> temp(bytes);
  const cl::loss<T, Temp, Scale, cl::algorithm::fused> host(device_temperature<Temp>(), device_scaler<T, Scale>());
  auto read_state = [&]
  {
    state_type st{};
    EXPECT_EQ(cudaMemcpy(&st, d_state.ptr, sizeof(st), cudaMemcpyDeviceToHost), cudaSuccess);
    return st;
  };

  // More gradients than the kernel's 1024 x 256 threads (the grid-stride loop runs twice), not a multiple of 256.
  const std::size_t count = 300007;
  std::vector<float> grads(count);
  std::mt19937 rng(7203);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto& g : grads)
  {
    g = normal(rng) * start_scale<T>();
  }
  device_buffer<float> d_grads(count);

  // 1. Finite gradients.
  CUDA_OK(device_loss::forward_backward(temp.ptr, bytes, dp, d_dq.ptr, d_dk.ptr, d_state.ptr));
  CUDA_OK(d_grads.upload(grads));
  CUDA_OK(device_loss::unscale_and_check(d_grads.ptr, count, d_state.ptr));
  CUDA_OK(cudaDeviceSynchronize());
  state_type st = read_state();
  ASSERT_TRUE(st.record.pending);
  EXPECT_EQ(st.record.first_nonfinite, cl::nonfinite_site::none);
  const auto unscaled = d_grads.download();
  std::vector<float> want = grads;
  cl::step_record host_rec = st.record;
  ASSERT_TRUE(host.unscale_and_check(want.data(), count, host_rec).ok());
  EXPECT_EQ(host_rec.first_nonfinite, cl::nonfinite_site::none);
  EXPECT_TRUE(same_bits(unscaled, want)) << "the device and host paths multiply by the same factor";
  double worst = 0.0;
  for (std::size_t i = 0; i < count; ++i)
  {
    const double exact = double(grads[i]) / double(st.record.loss_scale);
    worst = std::max(worst, std::fabs(unscaled[i] - exact) / std::max(std::fabs(exact), 1e-30));
  }
  EXPECT_LE(worst, 2 * tol::u_f) << "one rounding of the factor, one of the product";
  CUDA_OK(device_loss::finish_step(d_state.ptr));
  st = read_state();
  EXPECT_FALSE(st.record.skipped);
  EXPECT_EQ(st.step, 1);
  const float theta_after_finite = st.temperature.theta;
  const float scale_after_finite = st.scaler.loss_scale();

  // 2. An inf and a NaN (the last element: the grid-stride tail) flag the step; finish_step skips it.
  std::vector<float> bad = grads;
  bad[17] = INFINITY;
  bad[count - 1] = NAN;
  CUDA_OK(device_loss::forward_backward(temp.ptr, bytes, dp, d_dq.ptr, d_dk.ptr, d_state.ptr));
  CUDA_OK(d_grads.upload(bad));
  CUDA_OK(device_loss::unscale_and_check(d_grads.ptr, count, d_state.ptr));
  CUDA_OK(cudaDeviceSynchronize());
  st = read_state();
  ASSERT_TRUE(st.record.pending);
  EXPECT_EQ(st.record.first_nonfinite, cl::nonfinite_site::parameters);
  host_rec = st.record;
  host_rec.first_nonfinite = cl::nonfinite_site::none;
  want = bad;
  ASSERT_TRUE(host.unscale_and_check(want.data(), count, host_rec).ok());
  EXPECT_EQ(host_rec.first_nonfinite, cl::nonfinite_site::parameters);
  EXPECT_TRUE(same_values(d_grads.download(), want));
  CUDA_OK(device_loss::finish_step(d_state.ptr));
  st = read_state();
  EXPECT_TRUE(st.record.skipped);
  EXPECT_FALSE(st.record.pending);
  EXPECT_EQ(st.record.first_nonfinite, cl::nonfinite_site::parameters);
  EXPECT_EQ(st.temperature.theta, theta_after_finite);
  EXPECT_EQ(st.scaler.loss_scale(), 0.5f * scale_after_finite);
  EXPECT_EQ(st.record.next_loss_scale, 0.5f * scale_after_finite);
  EXPECT_EQ(st.step, 2);

  // 3. No step in progress: nothing is unscaled and nothing is flagged.
  CUDA_OK(d_grads.upload(grads));
  CUDA_OK(device_loss::unscale_and_check(d_grads.ptr, count, d_state.ptr));
  CUDA_OK(cudaDeviceSynchronize());
  EXPECT_TRUE(same_bits(d_grads.download(), grads));
  EXPECT_EQ(read_state().record.first_nonfinite, cl::nonfinite_site::parameters);
}

// A NaN logit reaches the reported values: the record's loss and max logit are NaN (fmaxf would drop it; with the
// info_nce objective the row of a NaN query then reported a finite loss), the step is diagnosed `logits` and skipped.
template <class T, class Algo>
void check_nan_logits_are_reported()
{
  using device_loss = cl::device::loss<T, cl::temperature::learnable, cl::scaler::dynamic, Algo>;
  SCOPED_TRACE(std::string(cl::element_traits<T>::name) + " " + Algo::name);
  const std::size_t n_q = 40, n_k = 90, dim = 16;
  auto q = ct::random_rows<T>(n_q, dim, 7301);
  const auto k = ct::random_rows<T>(n_k, dim, 7302);
  for (std::size_t c = 0; c < dim; ++c)
  {
    q[5 * dim + c] = cl::element_traits<T>::from_float(NAN); // every logit of query 5, its positive included
  }
  device_buffer<T> d_q(q.size()), d_k(k.size()), d_dq(q.size()), d_dk(k.size());
  ASSERT_EQ(d_q.upload(q), cudaSuccess);
  ASSERT_EQ(d_k.upload(k), cudaSuccess);
  const cl::problem<T> dp{d_q.ptr, d_k.ptr, n_q, n_k, dim, nullptr, cl::objective::info_nce};
  typename device_loss::state_type init{};
  ASSERT_TRUE(device_loss::make_state(
                  device_temperature<cl::temperature::learnable>(), device_scaler<T, cl::scaler::dynamic>(), init)
                  .ok());
  device_buffer<typename device_loss::state_type> d_state(1);
  ASSERT_EQ(cudaMemcpy(d_state.ptr, &init, sizeof(init), cudaMemcpyHostToDevice), cudaSuccess);
  std::size_t bytes = 0;
  ASSERT_EQ(device_loss::step(nullptr, bytes, dp, d_dq.ptr, d_dk.ptr, d_state.ptr), cudaSuccess);
  device_buffer<unsigned char> temp(bytes);
  ASSERT_EQ(device_loss::step(temp.ptr, bytes, dp, d_dq.ptr, d_dk.ptr, d_state.ptr), cudaSuccess);
  typename device_loss::state_type st{};
  ASSERT_EQ(cudaMemcpy(&st, d_state.ptr, sizeof(st), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_TRUE(std::isnan(st.record.loss)) << st.record.loss;
  EXPECT_TRUE(std::isnan(st.record.max_logit)) << st.record.max_logit;
  EXPECT_EQ(st.record.first_nonfinite, cl::nonfinite_site::logits);
  EXPECT_TRUE(st.record.skipped);
  EXPECT_EQ(st.temperature.theta, init.temperature.theta);
}

TEST(Device, NanLogitsReachTheReportedLossAndMaxLogit)
{
  SKIP_WITHOUT_DEVICE();
  check_nan_logits_are_reported<float, cl::algorithm::fused>();
  check_nan_logits_are_reported<__half, cl::algorithm::fused>();
  check_nan_logits_are_reported<__nv_bfloat16, cl::algorithm::materialized>();
}

// The fp16 gradient tile's scale 2^k ~ n: k = ceil(log2 n), clamped so that |G| <= 2 stays far below 65504.
TEST(Device, Fp16GradientTileShift)
{
  using cl::device::gradient_tile_shift;
  constexpr int max_shift = cl::device::kernel_traits<__half>::max_gradient_shift;
  EXPECT_EQ(gradient_tile_shift(1, max_shift), 0);
  EXPECT_EQ(gradient_tile_shift(2, max_shift), 1);
  EXPECT_EQ(gradient_tile_shift(3, max_shift), 2);
  EXPECT_EQ(gradient_tile_shift(4096, max_shift), 12);
  EXPECT_EQ(gradient_tile_shift(4097, max_shift), 13);
  EXPECT_EQ(gradient_tile_shift(std::int64_t(1) << 30, max_shift), max_shift);
  EXPECT_LT(2.0 * std::ldexp(1.0, max_shift), 65504.0 / 3);
  EXPECT_TRUE(cl::device::kernel_traits<__half>::scale_gradient_tile);
  EXPECT_FALSE(cl::device::kernel_traits<__nv_bfloat16>::scale_gradient_tile);
  EXPECT_FALSE(cl::device::kernel_traits<float>::scale_gradient_tile);
}
